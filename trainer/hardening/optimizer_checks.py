"""What the optimizers need before a run starts: fused AdamW that skips a step where `found_inf` is set (the device-side
skip of trainer_utils.optimizer_step); for --optimizer muon a torch that ships Muon, and not --parallel fsdp; and how
many parameters Muon trains, for the memory check (flag_checks.check_fits_in_memory)."""

from __future__ import annotations

import argparse

import torch

from trainer.hardening.resume_checks import ConfigError

MUON_TORCH = "2.9"  # torch.optim.Muon first shipped in PyTorch 2.9


def check_fused_adamw_skips(adamw: type = torch.optim.AdamW, device: str = "cpu") -> None:
    """trainer_utils.optimizer_step skips a step with a non-finite gradient by setting `optimizer.found_inf`, which
    fused AdamW hands to its kernel (as GradScaler does): torch's contract, not a public API. A torch that stopped
    reading it would apply NaN steps, so it is tried before anything trains, on the CPU and on the device that trains:
    after one ordinary step, a NaN gradient with found_inf set must leave the weight, both moments and the step count
    exactly as they were."""
    weight = torch.nn.Parameter(torch.ones(2, device=device))
    optimizer = adamw([weight], lr=0.1, fused=True)
    weight.grad = torch.full_like(weight, 0.5)
    optimizer.step()  # moments that are not zero, so that a step that moved them shows
    before = [t.clone() for t in (weight.detach(), *optimizer.state[weight].values())]
    weight.grad = torch.full_like(weight, float("nan"))
    optimizer.found_inf = torch.ones((), device=device)
    optimizer.step()
    after = [weight.detach(), *optimizer.state[weight].values()]
    if len(after) != len(before) or not all(torch.equal(a, b) for a, b in zip(after, before)):
        raise ConfigError(f"torch {torch.__version__}: fused AdamW on {device} applied a step whose found_inf was set, "
                          f"so a NaN gradient would reach the weights; use a torch from 2.4 to the one "
                          f"requirements.txt names")


def check_optimizer_flags(args: argparse.Namespace) -> None:
    """Fused AdamW's skip (above); refuse --optimizer muon where it cannot run: a torch without Muon, or --parallel
    fsdp (Muon orthogonalises each matrix whole; an FSDP rank holds a slice of it). Muon's LR defaults to
    --learning_rate."""
    on_cuda = str(getattr(args, "device", "cpu")).startswith("cuda") and torch.cuda.is_available()
    for device in ("cpu", "cuda") if on_cuda else ("cpu",):
        check_fused_adamw_skips(device=device)
    if getattr(args, "optimizer", "adamw") != "muon":
        return
    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(f"--optimizer muon: needs torch.optim.Muon, in PyTorch >= {MUON_TORCH} (this is "
                          f"{torch.__version__}); upgrade torch or use --optimizer adamw")
    if args.parallel == "fsdp":
        raise ConfigError("--optimizer muon with --parallel fsdp: Muon needs each matrix whole and an FSDP rank "
                          "holds a slice; use --parallel ddp or --optimizer adamw")
    if args.learning_rate == 0:  # Muon's LR is the schedule's times muon_learning_rate / learning_rate
        raise ConfigError("--optimizer muon with --learning_rate 0: Muon's LR follows the schedule as a multiple of "
                          "--learning_rate; give --learning_rate > 0 (and --muon_learning_rate 0 to hold the "
                          "matrices still)")
    if args.muon_learning_rate is None:
        args.muon_learning_rate = args.learning_rate


def muon_matrix_parameters(config, args: argparse.Namespace) -> int:
    """With --optimizer muon, the parameters Muon trains (trainer_utils.make_optimizer: the *_proj matrices), counted from the sizes as
    flag_checks.parameter_count lays them out: per layer q, k, v, o and the MLP's (every expert's) three
    projections; else 0. Muon keeps one fp32 buffer for each where AdamW keeps two: 4 bytes fewer a parameter."""
    if getattr(args, "optimizer", "adamw") != "muon":
        return 0
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = 3 * hidden * config.intermediate_size * (config.num_experts if config.use_moe else 1)
    return config.num_hidden_layers * (attention + mlp)
