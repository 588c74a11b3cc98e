#!/usr/bin/env bash
# The CUDA path end to end on one GPU: pretrain and SFT with `python` and `torchrun --nproc_per_node 1`,
# in bf16, fp16 (GradScaler), eager and compiled (the default on CUDA), a resume, the anomaly policy
# judged at the log intervals, side-stream saves, --parallel fsdp, then the speed targets' benchmark.
#   bash benchmarks/gpu_proof.sh runs OUT_DIR     # training runs only (a few minutes)
#   bash benchmarks/gpu_proof.sh bench OUT_DIR    # benchmarks only
#   bash benchmarks/gpu_proof.sh all OUT_DIR 540  # within 540 s: the suite at minimind's shape, then the runs
# A run that fails is reported ("-> exit N") and the next one starts; one that would begin after the time
# budget is reported as skipped, and each is cut at the budget's end, so a short lease returns what it did.
set -uo pipefail
cd "$(dirname "$0")/.."
what=$1 out=$2 budget=${3:-3600}
deadline=$((SECONDS + budget))
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=0
size=(--hidden_size 256 --num_hidden_layers 4 --num_attention_heads 8 --num_key_value_heads 4 --max_seq_len 128
      --batch_size 32 --log_interval 10 --save_interval 20 --num_workers 2)
ck="$out/ckpt" w="$out/weights"
step() {
  local left=$((deadline - SECONDS))
  if [ "$left" -le 5 ]; then echo "== skipped (out of time): $*"; return; fi
  echo "== $*"; local t0=$SECONDS
  timeout "$left" "$@" > "$out/last.log" 2>&1; local rc=$?
  tail -n 4 "$out/last.log"
  echo "-> exit $rc in $((SECONDS - t0)) s"
  if [ "$rc" -ne 0 ]; then failed=$((failed + 1)); cat "$out/last.log" >> "$out/failures.log"; fi
}

if [ "$what" = all ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
  step timeout 330 python benchmarks/bench.py --suite gpu --shapes minimind --workdir "$out/bench"
  cp "$out/last.log" "$out/bench_gpu.txt"
  step python benchmarks/count_ops.py
  what=runs
fi

if [ "$what" = runs ]; then
  # the first runs are the ones no CPU test covers: NCCL with the gloo vote group, fp16's GradScaler,
  # the background save's step pre-hook on CUDA, FSDP on CUDA; then compiled variants.
  step python trainer/train_pretrain.py "${size[@]}" --dtype bfloat16 --use_compile 0 --max_steps 40 --save_dir "$w" --checkpoint_dir "$ck"
  step torchrun --nproc_per_node 1 trainer/train_pretrain.py "${size[@]}" --dtype bfloat16 --max_steps 20 --save_dir "$w" --checkpoint_dir "$ck" --from_resume 1
  # Rollbacks under compile, with background saves on the side stream; fp16 under its GradScaler:
  step python trainer/train_pretrain.py "${size[@]}" --dtype float16 --on_anomaly rollback --save_interval 10 \
    --debug_inject nan:15 --max_steps 30 --save_dir "$out/anomaly16" --checkpoint_dir "$out/anomaly16ck"
  # FSDP on CUDA: bf16 mixed precision over fp32 slices, each layer compiled, sharded saves; a DDP run's
  # checkpoint continued under FSDP, then the sharded one continued under DDP and consolidated.
  step torchrun --nproc_per_node 1 trainer/train_pretrain.py "${size[@]}" --parallel fsdp --dtype bfloat16 --max_steps 40 \
    --on_anomaly rollback --debug_inject nan:15 --save_interval 10 --save_dir "$out/fsdp" --checkpoint_dir "$out/fsdpck"
  step python trainer/train_full_sft.py "${size[@]}" --dtype bfloat16 --max_steps 40 --save_dir "$w" --checkpoint_dir "$ck"
  step torchrun --nproc_per_node 1 trainer/train_full_sft.py "${size[@]}" --dtype float16 --max_steps 20 --save_dir "$w" --checkpoint_dir "$ck" --from_resume 1
  step torchrun --nproc_per_node 1 trainer/train_pretrain.py "${size[@]}" --parallel fsdp --dtype bfloat16 --max_steps 20 --save_dir "$w" --checkpoint_dir "$ck" --from_resume 1
  step python trainer/train_pretrain.py "${size[@]}" --dtype bfloat16 --max_steps 20 --save_dir "$w" --checkpoint_dir "$ck" --from_resume 1
  step python scripts/consolidate_checkpoint.py "$(ls -d "$out"/fsdpck/*_history/step_*.dcp | tail -n 1)" --out "$out/fsdp_consolidated.pth"
  step python trainer/train_pretrain.py "${size[@]}" --dtype bfloat16 --on_anomaly rollback --save_interval 10 \
    --debug_inject nan:15,spike:27 --max_steps 40 --save_dir "$out/anomaly" --checkpoint_dir "$out/anomalyck"
  step python trainer/train_pretrain.py "${size[@]}" --dtype bfloat16 --use_compile 0 --max_steps 20 --save_dir "$w" --checkpoint_dir "$ck" --from_resume 1
  step python trainer/train_pretrain.py "${size[@]}" --dtype float16 --max_steps 40 --save_dir "$out/fp16" --checkpoint_dir "$out/fp16ck"
  step torchrun --nproc_per_node 1 trainer/train_full_sft.py "${size[@]}" --dtype bfloat16 --use_compile 1 --max_steps 40 --save_dir "$w" --checkpoint_dir "$out/sftcompiled"
fi

if [ "$what" = bench ]; then
  python benchmarks/count_ops.py | tee "$out/ops.txt"
  python benchmarks/bench.py --suite gpu | tee "$out/bench_gpu.txt"
fi

echo "failed runs: $failed"
exit $((failed > 0))
