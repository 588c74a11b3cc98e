"""How a run stops on a signal: SIGTERM (a preemptible machine going away) and Ctrl-C only set a flag;
the loop finishes the optimizer step it is in, saves, and exits 0 with `continue_command`'s line. The
ranks agree on that step by a vote after every step (`StopRequest.vote`, a line of the loop), on the host.
Any later signal changes nothing (see `StopRequest`): the stop-save completes on every rank, its DataLoader
workers included (`loader_worker_ignores_stops`)."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from trainer.hardening.background_save import finish_saves


class StopRequest:
    """Set by SIGTERM or SIGINT; the loop reads `signal` (None, or the first signal's name) once per step.

    The handler never raises. A KeyboardInterrupt raised on one rank inside a collective would leave the
    others on a dead peer and the save half done, so a second signal is not an abort. The same signal
    often arrives twice at once (Slurm's scancel or a container runtime signals every process, and
    torchrun forwards its own copy to the workers): one stop. A later one (Ctrl-C pressed again) gets one
    line on rank 0 saying the stop is under way and how to abort without saving.
    """

    SAME_REQUEST_WITHIN_S = 1.0  # copies of one request arrive within milliseconds; a person presses again later

    def __init__(self):
        self.signal: str | None = None
        self._quiet_until = 0.0
        self._is_main = os.environ.get("RANK", "0") == "0"  # torchrun sets RANK; a plain run is rank 0
        self._pid = os.getpid()  # DataLoader workers forked later inherit this handler; they stay silent
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)
        # The vote goes over gloo, between the hosts: an NCCL collective would be read back from the GPU,
        # a wait for the device at every step. (Every rank creates the group here, at the same point.)
        self._vote_group = None
        if dist.is_initialized() and dist.get_backend() != "gloo":
            self._vote_group = dist.new_group(backend="gloo")

    def vote(self, saver) -> bool:
        """True if a stop was requested on any rank. Every rank calls it after every step: one all-reduce of two
        numbers between the hosts, so all ranks stop after the same step, and no rank waits for its device. If a
        rank's background save failed or its directory lock was lost (`saver.failed`), every rank raises here."""
        flags = torch.tensor([self.signal is not None, saver.failed], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flags, group=self._vote_group)
        stop, save_failed = flags.tolist()
        if save_failed:
            finish_saves(saver)  # raises on every rank: the writer's error, or LockLost (run_lock.py)
        return stop > 0

    def _request(self, signum, frame) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.signal is None:
            self.signal, self._quiet_until = name, now + self.SAME_REQUEST_WITHIN_S
            return
        if now < self._quiet_until or not self._is_main or os.getpid() != self._pid:
            return
        self._quiet_until = now + self.SAME_REQUEST_WITHIN_S
        if "LOCAL_RANK" in os.environ:  # rank 0 alone writes; killing only it leaves the others in a collective
            launcher = os.getppid()  # torchrun: killed too, or its --max-restarts would start the workers again
            abort = f"pkill -9 -P {launcher}; kill -9 {launcher}  (torchrun's workers, then torchrun; on each node)"
        else:
            abort = f"kill -9 {os.getpid()}"
        # os.write, not print: a handler that prints while the interrupted code is inside a print to the
        # same stream fails with "reentrant call"; one small write to a file descriptor is whole.
        os.write(2, f"stop under way ({name} again): the step in progress finishes, then the checkpoint is saved; "
                    f"more signals change nothing. To abort without saving: {abort}\n".encode())


def loader_worker_ignores_stops(worker_id: int) -> None:
    """The DataLoader's `worker_init_fn`: a stop belongs to the training process, and its loader workers must
    outlive the signal until the stop-save is written. The signal reaches them too: torchrun sends it to each
    worker's whole process group, a terminal's Ctrl-C to the foreground group, Slurm to every process of the
    job. A worker dying of it ("worker killed by signal: Terminated") would fail the run before it saves.

    SIGINT is ignored. SIGTERM keeps the one meaning PyTorch gives it in a worker: sent by the training
    process (ending a worker that did not stop in time, or at exit), it ends the worker quietly; from anyone
    else it is now ignored, where PyTorch's handler would die of it. A worker whose training process is gone
    ends by itself within seconds (PyTorch's watchdog), so nothing is left behind."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Blocked in this thread and every thread it starts, so only the waiting thread below receives SIGTERM.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_end_on_sigterm_from, args=(os.getppid(),), name="sigterm", daemon=True).start()


def _end_on_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # as PyTorch's worker handler does: exit 0, so the loader reports no failed worker


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


def end_of_run(at, args, stop_signal: str | None, world_size: int) -> str:
    """The run's last log line: where it ended (`at`, a Position), and how to continue a run that stopped early."""
    if at.epoch >= args.epochs:
        return f"training finished at step {at.global_step}; weights in {args.save_dir}"
    reason = stop_signal or f"--max_steps {args.max_steps} reached"
    return (f"stopped at step {at.global_step} ({reason}); checkpoint saved. To continue: "
            f"{continue_command(sys.argv, world_size)}")
