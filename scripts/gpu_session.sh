#!/usr/bin/env bash
# What to measure on one GPU lent for a few minutes, in one command, most wanted first: each part under a time
# budget of its own (one slow part cannot eat the others), its output and log under $OUT, one summary line per
# part in $OUT/summary.txt. From the repository's root:
#
#     OUT=/somewhere bash scripts/gpu_session.sh            # one GPU: at most 9.8 minutes in all
#     DEVICE=cpu OUT=/tmp/dry bash scripts/gpu_session.sh   # the same parts at tiny scale (a dry run on a machine
#                                                           # without a GPU; the benchmark takes a GPU where it finds one)
#
# OUT (default /tmp/gpu_session) must be empty or new: a demo run refuses a folder that holds one. The exit
# status is the number of parts that did not end well.
#
# 1. the speed benchmark (scripts/benchmark.py --suite gpu): t5-large, bf16, 512/150 tokens, batch 64, dropout
#    0; FSDP1 against one rank without FSDP, with sdpa and with t5_flex (with and without activation
#    checkpointing), and the stock HF model (docs/throughput.md: "On one GPU");
# 2. scripts/gpu_check.py: backends, host syncs, t5_flex's FlexAttention backward, one rank without FSDP and its
#    SDPA kernels, a sharded save and load, generation's all-gathers;
# 3. the embedded demo on the GPU for 20 steps, saving twice, its evaluation (32 rows), its export loaded back;
# 4. packed blocks through SDPA and FlexAttention (scripts/packing_kernels.py, a TinyLlama-shaped model).
# World size 1: NCCL refuses two ranks on one GPU, so FSDP1 runs NO_SHARD and FSDP2 skips its collectives.
set -u
OUT=$(realpath -m "${OUT:-/tmp/gpu_session}")  # before the cd: a relative OUT is the caller's
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python}
export PYTHONUNBUFFERED=1
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
    echo "OUT=$OUT is not empty: give a new folder (a demo run refuses one that holds a run)" >&2
    exit 2
fi
mkdir -p "$OUT"
failed=0

part() {  # part NAME BUDGET_S COMMAND...: run it under the budget (5 s more to die after SIGTERM), log to
    local name=$1 budget=$2 started=$SECONDS  # $OUT/NAME.log, say how it ended; 0 if it ended well
    shift 2
    timeout --kill-after=5 "$budget" "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    local said="exit $status"
    case $status in
        124 | 137) said="over its budget, stopped" ;;
    esac
    echo "$name: $said after $((SECONDS - started)) s (budget $budget s); log $OUT/$name.log" | tee -a "$OUT/summary.txt"
    [ "$status" -eq 0 ] || failed=$((failed + 1))
    return "$status"
}

if [ "$DEVICE" = cuda ]; then
    models=(t5-large) lengths=(512 150) batch=64 steps=6 shape=tinyllama-1.1b block=2048 kernels=(sdpa flex_attention)
    smoke_budget=50
else  # tiny: the embedded model, short sequences, FlexAttention's exactness only (no CPU backward)
    models=(embedded) lengths=(32 8) batch=2 steps=3 shape=tiny block=128 kernels=(sdpa)
    smoke_budget=120  # the demo's 20 steps and 32 generated summaries take 30 to 50 s on 2 CPU cores
fi

part benchmark 360 "$PYTHON" scripts/benchmark.py --suite gpu --models "${models[@]}" \
    --max_source_length "${lengths[0]}" --max_target_length "${lengths[1]}" --batch_size "$batch" \
    --steps "$steps" --dropout_rate 0 --time_budget_s 330 --out "$OUT/bench" --cases "bf16, FSDP1" \
    "bf16, no FSDP (one rank)" "bf16, FSDP1, t5_flex" "bf16, FSDP1, t5_flex, no activation checkpointing" \
    "bf16, no FSDP (one rank), t5_flex, no activation checkpointing"
part gpu_check 90 "$PYTHON" -m torch.distributed.run --nproc_per_node 1 --standalone scripts/gpu_check.py \
    --device "$DEVICE" --output "$OUT/gpu_check.json"
part smoke "$smoke_budget" "$PYTHON" -m torch.distributed.run --nproc_per_node 1 --standalone T5_training.py \
    --device "$DEVICE" --max_steps 20 --save_every_n_steps 10 --num_val_samples 32 --output_dir "$OUT/smoke" &&
    part smoke_export 20 "$PYTHON" -c "import sys; from transformers import AutoModelForSeq2SeqLM as M; \
print(M.from_pretrained(sys.argv[1]).num_parameters(), 'parameters loaded')" "$OUT/smoke/hf_model"
part packing 45 "$PYTHON" scripts/packing_kernels.py --shape "$shape" --max_seq_len "$block" --batch_size 4 \
    --steps "$steps" --kernels "${kernels[@]}" --out "$OUT/packing.json"
echo "done, $failed part(s) not ending well: $OUT/summary.txt" | tee -a "$OUT/summary.txt"
exit "$failed"
