"""Export project weights as a Hugging Face model directory, and import one back.

Run from the repository root (or as `python scripts/export_hf.py ...` from anywhere):

    # an out/*.pth file: every size is read from the weights (ours or minimind's)
    python -m scripts.export_hf out/full_sft_128.pth -o hf_model
    # size flags are optional and checked against the file; the MoE top-k is the one size no
    # tensor records, so an MoE file takes --num_experts_per_tok (default 1, as in minimind)
    python -m scripts.export_hf out/full_sft_768_moe.pth -o hf_model --num_experts_per_tok 1
    # a resume file carries its config
    python -m scripts.export_hf checkpoints/full_sft_128_resume.pth -o hf_model --dtype bfloat16
    # the reverse: a Hugging Face directory (Qwen3 layout) -> an out/-style FP16 .pth
    python -m scripts.export_hf hf_model --reverse -o out/imported_128.pth

The work is done by model/hf.py; this file is only the command line.
"""

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python scripts/x.py): make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from model.hf import DTYPES, export_hf, import_hf, infer_sizes, load_project_weights, size_flags
from model.tokenizer import DEFAULT_TOKENIZER

SIZE_FLAGS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "use_moe", "intermediate_size", "num_experts", "num_experts_per_tok")


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="out/*.pth or *_resume.pth to export; with --reverse, a Hugging Face directory")
    parser.add_argument("-o", "--output", required=True, help="directory to write; with --reverse, the .pth file")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float16", help="dtype of the exported weights")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="tokenizer.json to ship with the model")
    parser.add_argument("--reverse", action="store_true", help="import a Hugging Face directory into an out/-style .pth")
    sizes = parser.add_argument_group("model size (optional: read from the weights; a flag given must match them)")
    for name in SIZE_FLAGS:
        sizes.add_argument(f"--{name}", type=int, default=None, **({"choices": [0, 1]} if name == "use_moe" else {}))
    return parser


def export(args: argparse.Namespace) -> None:
    requested = {name: getattr(args, name) for name in SIZE_FLAGS}
    state_dict, lm_config = load_project_weights(args.path, requested)
    if lm_config.use_moe and args.num_experts_per_tok is None:
        # A resume file records the top-k; a bare state dict cannot, so there it is the default.
        print(f"note: MoE top-k num_experts_per_tok={lm_config.num_experts_per_tok} (from a resume file's config, "
              f"else the default; pass --num_experts_per_tok to choose)")
    out_dir = export_hf(state_dict, lm_config, args.output, args.tokenizer, DTYPES[args.dtype])
    print(f"wrote {out_dir}/ ({args.dtype}); try: AutoModelForCausalLM.from_pretrained({str(out_dir)!r})")


def reverse(args: argparse.Namespace) -> None:
    state_dict, lm_config = import_hf(args.path)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fp16 = {name: t.half() for name, t in state_dict.items()}
    if lm_config.tie_word_embeddings:  # keep one shared tensor, as the model's own state_dict does
        fp16["lm_head.weight"] = fp16["model.embed_tokens.weight"]
    torch.save(fp16, output)
    top_k = f"; its MoE top-k is {lm_config.num_experts_per_tok}" if lm_config.use_moe else ""
    print(f"wrote {output} (FP16, {len(fp16)} tensors): {size_flags(infer_sizes(fp16))}{top_k}")


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        if args.reverse:
            reverse(args)
        else:
            export(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
