#!/usr/bin/env bash
# The whole pipeline on a laptop-class CPU in a few minutes:
#   demo data -> pretrain -> SFT -> LoRA -> DPO -> GRPO -> distillation -> tool use -> agentic GRPO -> before-and-after table -> chat
#   -> curves.
# Sizes are small on purpose (a ~1M-parameter model, 0.59M with --quick); the flags are the same on a GPU.
#
#   bash scripts/run_demo.sh                  # 4 layers, 2 epochs of pretraining and 2 of SFT: 14 min 59 s on a quiet 2-core CPU
#   bash scripts/run_demo.sh --quick          # the same stages on 2 layers, 1 epoch of pretraining: 8 min 55 s there
#   bash scripts/run_demo.sh --check_machine  # only the check below: is the machine busy or small?
#
# It first looks at the machine: on fewer than 2 cores, or with a 1-minute load average of half the cores or
# more (other work running), it says so in one line and how to run faster (what the run does not do already).
# For tests, DEMO_CORES and DEMO_LOADAVG stand in for the machine's cores and the first number of /proc/loadavg.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash scripts/run_demo.sh [--quick] [--check_machine]"
layers=4 pretrain_epochs=2 sft_epochs=2 check_only=0
for arg in "$@"; do
    case "$arg" in
        --quick) layers=2 pretrain_epochs=1 sft_epochs=2 ;;  # SFT makes the answers: it keeps a second epoch
        --check_machine) check_only=1 ;;
        *) echo "error: unknown argument '$arg'; $usage" >&2; exit 2 ;;
    esac
done

# Torch runs a thread per core, so a core taken by other work stalls every step (measured: 800-1,200 tokens/s
# instead of 13,000 under load; one thread per process ran 2-6x faster under the same load).
# The machine's cores, as this process may use them (CPU affinity, a container's cpuset): `nproc` alone would count
# OMP_NUM_THREADS, so with the advised OMP_NUM_THREADS=1 a 2-core machine would look like one core. macOS has
# only getconf and no /proc: there the cores alone decide.
cores=${DEMO_CORES:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)}
load=${DEMO_LOADAVG:-$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || true)}
busy() { [[ -n "$load" ]] && awk -v load="$load" -v cores="$cores" 'BEGIN { exit !(load >= cores / 2) }'; }
if (( cores < 2 )) || busy; then
    # Advise only what the run does not do already: one thread (which helps only where there are 2 cores or more)
    # and --quick.
    one_thread=0; [[ "${OMP_NUM_THREADS:-}" == 1 || cores -lt 2 ]] && one_thread=1
    quick=0; (( layers == 2 )) && quick=1
    prefix=""; [[ "${OMP_NUM_THREADS:-}" == 1 ]] && prefix="OMP_NUM_THREADS=1 "
    # Both at once, as the README says: each alone still leaves the demo slow on a busy machine.
    if (( ! one_thread )); then
        advice="faster: OMP_NUM_THREADS=1 bash scripts/run_demo.sh --quick (one thread per process suffers least)"
    elif (( ! quick )); then
        advice="faster: ${prefix}bash scripts/run_demo.sh --quick"
    else
        advice="it already runs as fast as it can here (one thread, --quick); the numbers will be the same, only later"
    fi
    unit=cores; (( cores == 1 )) && unit=core
    echo "== busy or small machine (load average ${load:-unknown}, $cores $unit): the demo will be slow; $advice"
fi
if (( check_only )); then exit 0; fi

# Ctrl-C reaches every process in the foreground: a training script finishes its step, saves and exits 0
# (trainer/hardening/stopping.py); any other stage dies of it, and bash then runs this trap. Either way the demo stops
# there instead of starting the next stage from half-trained weights.
interrupted() { echo "== interrupted (Ctrl-C): the demo stops here, before the next stage (a training stage that was running saved a checkpoint; its \"To continue:\" line above resumes it)" >&2; exit 130; }
trap interrupted INT
# Bash acts on a Ctrl-C only if the foreground command died of it, and a trainer that stopped cleanly did not:
# so after each training stage its status file says whether it was stopped.
stop_if_stopped() { if grep -q '"status": "stopped"' "out/$1_status.json" 2>/dev/null; then interrupted; fi; }
# The same numbers on any x86 machine and any thread count: MKL's matrix products in its strict reproducible mode
# (results independent of the thread count and of AVX2 vs AVX-512) and torch's own kernels on AVX2 everywhere.
# Without these, 1 and 2 threads differed after 10 steps on an Intel CPU (last bits first; on an AMD EPYC they
# agreed), and the demo's small models ended in different places (exact match after SFT moved 16 points between two
# machines). Set either yourself to override.
export MKL_CBWR="${MKL_CBWR:-AVX2,STRICT}"
if [[ "$(uname -m)" == x86_64 ]]; then export ATEN_CPU_CAPABILITY="${ATEN_CPU_CAPABILITY:-avx2}"; fi
SIZE=(--hidden_size 128 --num_hidden_layers "$layers" --num_attention_heads 4 --num_key_value_heads 2)
STUDENT=(--hidden_size 128 --num_hidden_layers "$((layers / 2))" --num_attention_heads 4 --num_key_value_heads 2)

echo "== 1. demo data (deterministic: rewrites the committed files byte for byte)"
python dataset/make_demo_data.py
python dataset/make_stage_data.py

echo "== 2. pretrain"
# Muon for the attention and MLP matrices, AdamW for the rest: AdamW's final loss in about 0.7 of its time on a CPU,
# and lower at the end (docs/speed.md, "Time to a loss")
python trainer/train_pretrain.py "${SIZE[@]}" --max_seq_len 128 --batch_size 32 --learning_rate 2e-3 \
    --optimizer muon --muon_learning_rate 4e-3 \
    --epochs "$pretrain_epochs" --log_interval 50 --save_interval 200 --val_data dataset/val_demo.jsonl --eval_interval 200
stop_if_stopped pretrain_128

echo "== 3. supervised fine-tuning (starts from out/pretrain_128.pth)"
python trainer/train_full_sft.py "${SIZE[@]}" --max_seq_len 192 --batch_size 32 --learning_rate 1e-3 \
    --epochs "$sft_epochs" --log_interval 50 --save_interval 200
stop_if_stopped full_sft_128

# The stages after SFT train on short conversations: 64 tokens hold each of them.
echo "== 4. LoRA: a task SFT never taught (translating words), out/full_sft_128.pth frozen, an adapter trained"
python trainer/train_lora.py "${SIZE[@]}" --max_seq_len 64 --batch_size 32 --learning_rate 3e-3 \
    --lora_rank 16 --lora_alpha 32 --epochs 8 --log_interval 50 --save_interval 200
stop_if_stopped lora_demo_128

echo "== 5. DPO: the right answer preferred to a wrong one, from out/full_sft_128.pth against a frozen copy"
python trainer/train_dpo.py "${SIZE[@]}" --max_seq_len 64 --batch_size 32 --learning_rate 3e-5 --beta 0.1 \
    --epochs 2 --log_interval 10 --save_interval 200
stop_if_stopped dpo_128

# GRPO asks the eval's phrasing, which SFT never used, about the items the eval does not ask (make_stage_data.py);
# the answer reward alone, so the reward curve reads as the share of sampled answers that are right. 32 questions a
# step (256 answers): fewer make each step's reward depend mostly on which questions it drew.
echo "== 6. GRPO: 8 answers sampled per question from out/full_sft_128.pth, each judged against its group by the answer reward"
python trainer/train_grpo.py "${SIZE[@]}" --max_seq_len 64 --max_completion_len 16 --batch_size 32 --num_generations 8 \
    --learning_rate 2e-4 --epochs 6 --rewards answer --log_interval 2 --save_interval 200
stop_if_stopped grpo_128

# A student half as deep, from random weights, trained twice on SFT's data with SFT's steps and seed: by SFT alone, and
# distilled from out/full_sft_128.pth's logits (alpha 0.5: half the loss SFT's, half the teacher's). Temperature 1:
# at the stage's default 2 the distilled student answered 14/164, below SFT alone's 38 (docs/demo.md).
echo "== 7. distillation: a $((layers / 2))-layer student from the $layers-layer SFT model, beside the same student by SFT alone"
python trainer/train_full_sft.py "${STUDENT[@]}" --from_weight none --save_weight student_sft --max_seq_len 192 \
    --batch_size 32 --learning_rate 1e-3 --epochs "$sft_epochs" --log_interval 50 --save_interval 200
stop_if_stopped student_sft_128
python trainer/train_distillation.py "${STUDENT[@]}" --teacher_weight full_sft --save_weight student_distill \
    --alpha 0.5 --temperature 1 --max_seq_len 192 --batch_size 32 --learning_rate 1e-3 --epochs "$sft_epochs" --log_interval 50 --save_interval 200
stop_if_stopped student_distill_128

# Tool use: SFT's model taught to call dataset/tools.py's calculator and weather tool (dataset/tool_sft_demo.jsonl:
# the call, the tool's real result, the answer from it; and questions that need no call). Both tools are offered in
# the system turn, about 540 tokens; three questions follow it in each conversation (more copying per token), so its
# sequences hold 960 tokens. Scored on questions in a phrasing its data never used (eval_tools.py on
# dataset/tool_demo_eval.jsonl). One epoch, 250 steps: the copying of the question's numbers into the call shows only
# from some 200 steps on (125 steps: 2 of 48 all right; 250: 9; 500: 20). Its own weight name: the rows of the stages
# above stay as they were.
echo "== 8. tool use: out/full_sft_128.pth taught to call a calculator and a weather tool, scored on a phrasing it never saw"
python trainer/train_full_sft.py "${SIZE[@]}" --from_weight full_sft --save_weight tool_sft --data_path dataset/tool_sft_demo.jsonl \
    --max_seq_len 960 --batch_size 8 --learning_rate 2e-3 --epochs 1 --log_interval 25 --save_interval 200
stop_if_stopped tool_sft_128
python eval_tools.py --weight tool_sft "${SIZE[@]}"

# Agentic GRPO from the tool model: each question is answered 8 times, the calls it writes run and their results are
# appended (--max_turns 2: a call, then the answer), and the final answer is judged against its group. The questions
# are in the eval's phrasing, about what the eval does not ask (make_stage_data.py), as stage 6's. The answer reward
# alone: the tool reward pays any call that validates, needed or not. One epoch of 128 questions, 16 steps, some 12 s
# each here. On this model it lowers the tool-use score (22 -> 15 of 48 in the full demo): docs/demo.md gives every
# setting measured; the row is there to show what the stage did.
echo "== 9. agentic GRPO: out/tool_sft_128.pth calls its tools in 8 rollouts per question, each judged by its final answer"
python trainer/train_grpo.py "${SIZE[@]}" --from_weight tool_sft --save_weight tool_grpo --data_path dataset/tool_grpo_demo.jsonl \
    --max_turns 2 --rewards answer --max_seq_len 736 --max_completion_len 128 --batch_size 8 --num_generations 8 \
    --learning_rate 2e-4 --epochs 1 --log_interval 4 --save_interval 200
stop_if_stopped tool_grpo_128
python eval_tools.py --weight tool_grpo "${SIZE[@]}"

echo "== 10. before and after: random weights, pretrained, SFT, SFT + LoRA, DPO, GRPO, the students, tool use (SFT, tool SFT, agentic GRPO) on held-out data (scripts/demo_table.py)"
python scripts/demo_table.py "${SIZE[@]}"

echo "== 11. chat"
python eval_model.py --weight full_sft "${SIZE[@]}" --prompt "What is the capital of France?"
python eval_model.py --weight full_sft "${SIZE[@]}" --prompt "3加4等于几？"
python eval_model.py --weight full_sft --lora demo "${SIZE[@]}" --prompt "What is Paris in Chinese?"

echo "== 12. curves: pretraining's loss, GRPO's reward"
python scripts/plot_metrics.py out/pretrain_128_metrics.jsonl -o out/pretrain_128_curves.png
python scripts/plot_metrics.py out/grpo_128_metrics.jsonl -o out/grpo_128_curves.png
echo "== done in $((SECONDS / 60)) min $((SECONDS % 60)) s; the curves: out/pretrain_128_curves.png, out/grpo_128_curves.png"
