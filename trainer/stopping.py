"""How a run stops: on a signal at a step boundary, with a command to continue, and cleanly.

SIGTERM (a preemptible machine going away) and Ctrl-C only set a flag; the loop finishes the
optimizer step it is in, saves, and exits 0 with `continue_command`'s line. The teardown helper
exists because of a PyTorch exit-time abort with gloo/nccl (see its docstring).
"""

from __future__ import annotations

import gc
import os
import shlex
import signal


def install_stop_handlers(run) -> None:
    """SIGTERM (preemption) and SIGINT (Ctrl-C) finish the current step, save, and exit 0."""
    def request_stop(signum, frame):
        run.stop_signal = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts at once

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def release_before_teardown(run) -> None:
    """Drop the DDP wrapper while the process group still exists.

    DDP's reducer holds gloo/nccl work; destroyed after the group (by a late garbage collection,
    or at exit) it can abort the process after a successful run. The stop handlers' closure
    keeps `run` alive, so they are reset first, then cycles are collected now.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run.model = None
    gc.collect()


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
