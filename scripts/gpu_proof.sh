#!/usr/bin/env bash
# The CUDA path end to end on one GPU: pretrain and SFT with `python` and `torchrun --nproc_per_node 1`,
# in bf16, fp16 (GradScaler) and compiled, a resume, then the step and loop benchmarks.
#   bash scripts/gpu_proof.sh runs OUT_DIR     # training runs only (a few minutes)
#   bash scripts/gpu_proof.sh bench OUT_DIR    # benchmarks only
set -euo pipefail
cd "$(dirname "$0")/.."
what=$1 out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
size=(--hidden_size 256 --num_hidden_layers 4 --num_attention_heads 8 --num_key_value_heads 4 --max_seq_len 128
      --batch_size 32 --log_interval 10 --save_interval 20 --num_workers 2)
ck="$out/ckpt" w="$out/weights"
step() { echo "== $*"; "$@" 2>&1 | tail -n 4; }

if [ "$what" = runs ]; then
  step python trainer/train_pretrain.py "${size[@]}" --dtype bfloat16 --max_steps 40 --save_dir "$w" --checkpoint_dir "$ck"
  step python trainer/train_pretrain.py "${size[@]}" --dtype bfloat16 --max_steps 20 --save_dir "$w" --checkpoint_dir "$ck" --from_resume 1
  step torchrun --nproc_per_node 1 trainer/train_pretrain.py "${size[@]}" --dtype bfloat16 --max_steps 20 --save_dir "$w" --checkpoint_dir "$ck" --from_resume 1
  step python trainer/train_pretrain.py "${size[@]}" --dtype float16 --max_steps 40 --save_dir "$out/fp16" --checkpoint_dir "$out/fp16ck"
  step python trainer/train_pretrain.py "${size[@]}" --dtype bfloat16 --use_compile 1 --max_steps 40 --save_dir "$out/compiled" --checkpoint_dir "$out/compiledck"
  step python trainer/train_full_sft.py "${size[@]}" --dtype bfloat16 --max_steps 40 --save_dir "$w" --checkpoint_dir "$ck"
  step torchrun --nproc_per_node 1 trainer/train_full_sft.py "${size[@]}" --dtype float16 --max_steps 20 --save_dir "$w" --checkpoint_dir "$ck" --from_resume 1
  step torchrun --nproc_per_node 1 trainer/train_full_sft.py "${size[@]}" --dtype bfloat16 --use_compile 1 --max_steps 40 --save_dir "$w" --checkpoint_dir "$out/sftcompiled"
fi

if [ "$what" = bench ]; then
  for compile in 0 1; do
    python scripts/bench.py --hidden_size 768 --num_hidden_layers 8 --batch_size 32 --max_seq_len 340 --use_compile $compile --steps 30 | tee -a "$out/bench.jsonl"
  done
  python scripts/bench.py --hidden_size 768 --num_hidden_layers 16 --batch_size 16 --max_seq_len 1024 --use_compile 1 --steps 20 | tee -a "$out/bench.jsonl"
  for compile in 0 1; do
    python scripts/bench.py --mode loop --hidden_size 768 --num_hidden_layers 8 --batch_size 32 --max_seq_len 340 \
      --use_compile $compile --steps 300 --save_interval 100 --log_interval 50 --num_workers 4 --workdir /tmp/loop | tee -a "$out/bench.jsonl"
  done
fi
