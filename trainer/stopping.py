"""How a run stops on a signal: SIGTERM (a preemptible machine going away) and Ctrl-C only set a flag;
the loop finishes the optimizer step it is in, saves, and exits 0 with `continue_command`'s line."""

from __future__ import annotations

import os
import shlex
import signal


class StopRequest:
    """Set by SIGTERM or SIGINT; the loop reads `signal` (None, or the signal's name) once per step."""

    def __init__(self):
        self.signal: str | None = None
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts at once


def continue_command(argv: list[str], world_size: int) -> str:
    """The command that resumes this run, ready to paste: `python ...` or `torchrun ...`, with --from_resume 1."""
    args = list(argv[1:])
    if "--from_resume" in args[:-1]:
        args[args.index("--from_resume") + 1] = "1"
    else:
        args += ["--from_resume", "1"]
    if "LOCAL_RANK" not in os.environ:
        launcher = ["python"]
    else:  # the same torchrun layout; on several nodes, add your rendezvous flags as before
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        nodes = ["--nnodes", str(world_size // per_node)] if world_size > per_node else []
        launcher = ["torchrun", *nodes, "--nproc_per_node", str(per_node)]
    return shlex.join(launcher + [argv[0]] + args)
