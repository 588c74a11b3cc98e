"""One file from a sharded (--parallel fsdp) checkpoint: the FP16 inference weights, and a `_resume.pth` on request.

    python scripts/consolidate_checkpoint.py checkpoints/pretrain_768_history/step_00000300.dcp \\
        --out out/pretrain_768.pth [--resume_out checkpoints/pretrain_768_from_fsdp.pth]

The folder is checked against its manifest (size and SHA-256 of every file) first; then every shard is read
in this one process (no GPU, no process group), the head is tied to the embedding again, and the weights are
written as the FP16 `.pth` that eval_model.py, scripts/export_hf.py and minimind's tools read. The
`_resume.pth` is the single-file training state (FP32 weights, AdamW keyed by parameter number, cursor,
RNG...), with a manifest beside it so `--resume_path` accepts it. Files that exist are never overwritten.
"""

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python scripts/x.py): make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from output_paths import OutputPathError
from trainer.hardening import checkpoint_io, out_weights
from trainer.hardening.checkpoint_io import CheckpointError
from trainer.hardening.sharded_checkpoint import consolidate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a sharded checkpoint's folder, R_history/step_N.dcp")
    parser.add_argument("--out", type=Path, required=True, help="the FP16 weights file to write")
    parser.add_argument("--resume_out", type=Path, default=None, help="also write the training state as one file")
    args = parser.parse_args(argv)
    try:
        targets = [args.out]
        if args.resume_out is not None:
            targets += [args.resume_out, checkpoint_io.manifest_path(args.resume_out)]
        for target in targets:
            if target.exists():
                raise CheckpointError(f"{target} exists; it is left as it is: choose another name or move it away")
        problem = checkpoint_io.verify(args.checkpoint)
        if problem is not None:
            raise CheckpointError(f"{args.checkpoint} cannot be trusted: {problem}")
        state = consolidate(args.checkpoint)
        weights = out_weights.cast_state_dict(state["model"], torch.float16)  # tied tensors stay one
        args.out.parent.mkdir(parents=True, exist_ok=True)
        checkpoint_io.atomic_write(args.out, lambda f: torch.save(weights, f))
        print(f"wrote {args.out}: {len(weights)} FP16 tensors of step {state['global_step']}")
        if args.resume_out is not None:
            args.resume_out.parent.mkdir(parents=True, exist_ok=True)
            size, sha = checkpoint_io.atomic_write(args.resume_out, lambda f: torch.save(state, f))
            manifest = {"file": args.resume_out.name, "size": size, "sha256": sha, "step": state["global_step"],
                        "epoch": state["epoch"], "global_step": state["global_step"],
                        "samples_consumed": state["samples_consumed"], "consolidated_from": str(args.checkpoint)}
            checkpoint_io.atomic_write_text(checkpoint_io.manifest_path(args.resume_out),
                                            json.dumps(manifest, indent=1) + "\n")
            print(f"wrote {args.resume_out} and its manifest: resume from it with --resume_path {args.resume_out}")
    except (CheckpointError, OutputPathError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
