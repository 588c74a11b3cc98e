"""Run one torchrun worker and keep what torchrun does not show when it is signalled itself: the worker's
exit status and its output, apart from torchrun's own. A test puts this file where the training script
would go:

    torchrun --nproc_per_node 2 tests/record_worker.py DIR trainer/train_pretrain.py --flags ...

Each rank writes DIR/rank{RANK}.log (its stdout and stderr) and DIR/rank{RANK}.exit (its exit status).
The worker stays in this process's group, so what torchrun sends to the group reaches it unchanged.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

directory, command = Path(sys.argv[1]), [sys.executable, *sys.argv[2:]]
rank = os.environ["RANK"]
with open(directory / f"rank{rank}.log", "wb") as log:
    worker = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    # Only this process ignores them (set after the start, so the worker has the usual handlers): torchrun
    # signals the whole group, and the worker decides what its signals do.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = worker.wait()
(directory / f"rank{rank}.exit").write_text(f"{code}\n")
sys.exit(code if code >= 0 else 128 - code)  # a worker killed by signal N exits 128 + N, as in a shell
