"""Export project weights as a Hugging Face model directory, and import one back.

Run from the repository root (or as `python scripts/export_hf.py ...` from anywhere):

    # an out/*.pth file: every size is read from the weights (ours or minimind's)
    python -m scripts.export_hf out/full_sft_128.pth -o hf_model
    # size flags are optional and checked against the file; the MoE top-k is the one size no
    # tensor records, so an MoE file takes --num_experts_per_tok (default 1, as in minimind)
    python -m scripts.export_hf out/full_sft_768_moe.pth -o hf_model --num_experts_per_tok 1
    # a resume file carries its config
    python -m scripts.export_hf checkpoints/full_sft_128_resume.pth -o hf_model --dtype bfloat16
    # a LoRA adapter (trainer/train_lora.py) added into the exported weights: one plain model
    python -m scripts.export_hf out/full_sft_128.pth --merge_lora out/lora_demo_128.pth -o hf_model_demo
    # or kept apart, as a PEFT adapter folder over the plain export of its base (both run on the same file):
    python -m scripts.export_hf out/full_sft_128.pth --peft_adapter out/lora_demo_128.pth -o hf_lora_demo
    #   PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("hf_model"), "hf_lora_demo")
    # reading past the trained length (docs/long_context.md): config.json's rope_scaling, as transformers reads it
    python -m scripts.export_hf out/pretrain_128.pth -o hf_model_yarn --rope_scaling yarn --rope_factor 4
    # the reverse: a Hugging Face directory (Qwen3 layout) -> an out/-style FP16 .pth
    python -m scripts.export_hf hf_model --reverse -o out/imported_128.pth

A file already at the output (or in the output folder) is left as it is unless --force is given, and the
export never writes over its own input, --force or not; a link there is replaced, never written through,
and a FIFO or folder where a file goes is refused (the rules of output_paths.py, which the trainer follows
too). Every error is one line, exit 2. The work is done by model/hf.py; this file is only the command line.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python scripts/x.py): make the repo's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from model.hf import DTYPES, HF_FILES, export_hf, import_hf
from model.weights import infer_sizes, load_project_weights, size_flags
from model.lora import PEFT_FILES, export_peft, load_lora, merged_state_dict, note_if_another_base, read_adapter
from model.model import CausalLM, LMConfig
from model.rope import add_rope_scaling_flags, rope_scaling_of_flags
from model.tokenizer import DEFAULT_TOKENIZER
from output_paths import OutputPathError, atomic_write, check_output_folder, check_user_output
from trainer.hardening.out_weights import trained_length

SIZE_FLAGS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "use_moe", "intermediate_size", "num_experts", "num_experts_per_tok")


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="out/*.pth or *_resume.pth to export; with --reverse, a Hugging Face directory")
    parser.add_argument("-o", "--output", required=True, help="directory to write; with --reverse, the .pth file")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float16", help="dtype of the exported weights")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="tokenizer.json to ship with the model")
    parser.add_argument("--reverse", action="store_true", help="import a Hugging Face directory into an out/-style .pth")
    parser.add_argument("--force", action="store_true", help="replace files already at --output (never an input)")
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument("--merge_lora", default=None, help="an out/lora_*.pth adapter of `path`: export W + B A · α/r")
    lora.add_argument("--peft_adapter", default=None,
                      help="an out/lora_*.pth adapter of `path`: write it to --output as a PEFT adapter folder")
    add_rope_scaling_flags(parser)  # written as config.json's rope_scaling, which transformers reads
    sizes = parser.add_argument_group("model size (optional: read from the weights; a flag given must match them)")
    for name in SIZE_FLAGS:
        sizes.add_argument(f"--{name}", type=int, default=None, **({"choices": [0, 1]} if name == "use_moe" else {}))
    return parser


def inputs_of(args: argparse.Namespace) -> list[Path]:
    """Every file the command reads: none of them may be written over."""
    if args.reverse:
        return [Path(args.path) / name for name in HF_FILES]
    adapter = args.merge_lora or args.peft_adapter
    return [Path(args.path), Path(args.tokenizer)] + ([Path(adapter), Path(adapter).with_suffix(".json")]
                                                      if adapter else [])


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before anything is read or written, an output that is taken (without --force), one of the inputs,
    or the wrong kind of thing (a folder for the .pth, a file for the folder, a FIFO anywhere)."""
    output, inputs = Path(args.output), inputs_of(args)
    if args.reverse:
        check_user_output(output, args.force, inputs)
    else:
        check_output_folder(output, PEFT_FILES if args.peft_adapter else HF_FILES, args.force, inputs)


def export(args: argparse.Namespace) -> None:
    requested = {name: getattr(args, name) for name in SIZE_FLAGS}
    state_dict, lm_config = load_project_weights(args.path, requested)
    try:  # --rope_scaling: from out/{weight}.json's trained length, or --original_max_position_embeddings
        recorded = trained_length(Path(args.path))
    except RuntimeError as error:
        raise ValueError(str(error)) from None
    scaling = rope_scaling_of_flags(args, recorded, str(Path(args.path).with_suffix(".json")))
    lm_config = dataclasses.replace(lm_config, rope_scaling=scaling)
    if lm_config.use_moe and args.num_experts_per_tok is None:
        # A resume file records the top-k; a bare state dict cannot, so there it is the default.
        print(f"note: MoE top-k num_experts_per_tok={lm_config.num_experts_per_tok} (from a resume file's config, "
              f"else the default; pass --num_experts_per_tok to choose)")
    adapter_file = args.merge_lora or args.peft_adapter
    if adapter_file:  # put on the model it adapts: an adapter of another base is refused here
        model = CausalLM(lm_config)
        model.load_state_dict(state_dict, strict=True)
        settings = load_lora(model, adapter_file)
        note = note_if_another_base(settings, args.path)
        if note:
            print(note, file=sys.stderr)
        if args.peft_adapter:
            write_peft(args, lm_config, settings)
            return
        state_dict = merged_state_dict(model)
    out_dir = export_hf(state_dict, lm_config, args.output, args.tokenizer, DTYPES[args.dtype], overwrite=args.force)
    print(f"wrote {out_dir}/ ({args.dtype}); try: AutoModelForCausalLM.from_pretrained({str(out_dir)!r})")


def write_peft(args: argparse.Namespace, lm_config: LMConfig, settings: dict) -> None:
    """--peft_adapter: the adapter as a folder PEFT loads over the plain export of `path`."""
    mlp = {"gate_proj", "up_proj", "down_proj"} & set(settings.get("lora_targets", "").split(","))
    if lm_config.use_moe and mlp:
        raise ValueError(f"--peft_adapter {args.peft_adapter}: it adapts the MoE experts' {', '.join(sorted(mlp))}, "
                         f"which transformers' Qwen3-MoE keeps fused in one tensor that PEFT's LoRA cannot target; "
                         f"use --merge_lora instead")
    adapter, _ = read_adapter(args.peft_adapter)
    out_dir = export_peft(adapter, settings, args.output, DTYPES[args.dtype], overwrite=args.force,
                          inputs=inputs_of(args))
    print(f"wrote {out_dir}/ ({args.dtype}); try: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
          f"<the export of {args.path}>), {str(out_dir)!r})")


def reverse(args: argparse.Namespace) -> None:
    state_dict, lm_config = import_hf(args.path)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fp16 = {name: t.half() for name, t in state_dict.items()}
    if lm_config.tie_word_embeddings:  # keep one shared tensor, as the model's own state_dict does
        fp16["lm_head.weight"] = fp16["model.embed_tokens.weight"]
    check_user_output(output, args.force, inputs_of(args))  # again, right before: nothing appeared meanwhile
    atomic_write(output, lambda f: torch.save(fp16, f))  # a temp file, then a rename: a link there is replaced
    top_k = f"; its MoE top-k is {lm_config.num_experts_per_tok}" if lm_config.use_moe else ""
    print(f"wrote {output} (FP16, {len(fp16)} tensors): {size_flags(infer_sizes(fp16))}{top_k}")


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.reverse and (args.merge_lora or args.peft_adapter):
        parser.error("--merge_lora and --peft_adapter export an adapter; --reverse imports a model")
    try:
        check_outputs(args)
        if args.reverse:
            reverse(args)
        else:
            export(args)
    except (ValueError, OSError, OutputPathError) as error:  # the user's input, not a bug: one line, exit 2
        message = "; ".join(line.strip() for line in str(error).splitlines() if line.strip()).replace(":; ", ": ")
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
