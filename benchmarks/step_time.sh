#!/usr/bin/env bash
# Seconds per step of the demo's pretraining, AdamW against --optimizer muon, on this machine: the demo's shape and
# its pinned numerics (scripts/run_demo.sh), 60 steps a run, timed from the log lines of steps 10 and 60 (the start
# and the first steps left out), the two optimizers interleaved, twice.
#   bash benchmarks/step_time.sh            # some 4 minutes on 2 CPU cores
set -euo pipefail
cd "$(dirname "$0")/.."
export MKL_CBWR="${MKL_CBWR:-AVX2,STRICT}"
if [[ "$(uname -m)" == x86_64 ]]; then export ATEN_CPU_CAPABILITY="${ATEN_CPU_CAPABILITY:-avx2}"; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for rep in 1 2; do
  for opt in adamw muon; do
    run="$work/$opt$rep"
    extra=(); [[ $opt == muon ]] && extra=(--optimizer muon --muon_learning_rate 4e-3)
    python trainer/train_pretrain.py --hidden_size 128 --num_hidden_layers 4 --num_attention_heads 4 \
        --num_key_value_heads 2 --max_seq_len 128 --batch_size 32 --learning_rate 2e-3 "${extra[@]}" --max_steps 60 \
        --log_interval 10 --save_interval 100000 --save_dir "$run/out" --checkpoint_dir "$run/ck" \
        --metrics_dir "$run/m" --run_name "$opt" > "$run.log" 2>&1
    python - "$run" "$opt" <<'PY'
import glob, json, sys
lines = [json.loads(line) for line in open(glob.glob(sys.argv[1] + "/m/*metrics.jsonl")[0]) if '"loss"' in line]
at = {m["step"]: m["timestamp"] for m in lines if "timestamp" in m}
print(f"{sys.argv[2]}: {(at[60] - at[10]) / 50:.4f} s a step (steps 11-60)")
PY
  done
done
