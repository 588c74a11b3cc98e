#!/usr/bin/env bash
# The whole pipeline on a laptop-class CPU in a few minutes:
#   demo data -> pretrain -> SFT -> exact-match eval -> one chat answer -> loss curves.
# Sizes are small on purpose (a ~1M-parameter model); the flags are the same on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# Ctrl-C reaches every process in the foreground: a training script finishes its step, saves and exits 0
# (trainer/hardening/stopping.py); any other stage dies of it, and bash then runs this trap. Either way the demo stops
# there instead of starting the next stage from half-trained weights.
interrupted() { echo "== interrupted (Ctrl-C): the demo stops here, before the next stage (a training stage that was running saved a checkpoint; its \"To continue:\" line above resumes it)" >&2; exit 130; }
trap interrupted INT
# Bash acts on a Ctrl-C only if the foreground command died of it, and a trainer that stopped cleanly did not:
# so after each training stage its status file says whether it was stopped.
stop_if_stopped() { if grep -q '"status": "stopped"' "out/$1_status.json" 2>/dev/null; then interrupted; fi; }
SIZE=(--hidden_size 128 --num_hidden_layers 4 --num_attention_heads 4 --num_key_value_heads 2)

echo "== 1. demo data (deterministic: rewrites the committed files byte for byte)"
python dataset/make_demo_data.py

echo "== 2. pretrain"
python trainer/train_pretrain.py "${SIZE[@]}" --max_seq_len 128 --batch_size 32 --learning_rate 2e-3 \
    --epochs 3 --log_interval 50 --save_interval 200 --val_data dataset/val_demo.jsonl --eval_interval 200
stop_if_stopped pretrain_128

echo "== 3. supervised fine-tuning (starts from out/pretrain_128.pth)"
python trainer/train_full_sft.py "${SIZE[@]}" --max_seq_len 192 --batch_size 32 --learning_rate 1e-3 \
    --epochs 3 --log_interval 50 --save_interval 200
stop_if_stopped full_sft_128

echo "== 4. exact-match accuracy on held-out questions"
python eval_model.py --weight full_sft "${SIZE[@]}" --eval dataset/sft_demo_eval.jsonl

echo "== 5. chat"
python eval_model.py --weight full_sft "${SIZE[@]}" --prompt "What is the capital of France?"
python eval_model.py --weight full_sft "${SIZE[@]}" --prompt "3加4等于几？"

echo "== 6. loss curves"
python scripts/plot_metrics.py out/pretrain_128_metrics.jsonl -o out/pretrain_128_curves.png
