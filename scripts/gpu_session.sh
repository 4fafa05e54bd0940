#!/usr/bin/env bash
# What to measure on one GPU lent for a few minutes, in one command, most wanted first: each part under a time
# budget of its own (one slow part cannot eat the others), its output and log under $OUT, one summary line per
# part in $OUT/summary.txt. From the repository's root:
#
#     OUT=/somewhere bash scripts/gpu_session.sh            # one GPU: at most 9.6 minutes in all
#     DEVICE=cpu OUT=/tmp/dry bash scripts/gpu_session.sh   # the same parts at tiny scale on CPU (a dry run)
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
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_session}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

part() {  # part NAME BUDGET_S COMMAND...: run it under the budget, log to $OUT/NAME.log, say how it ended
    local name=$1 budget=$2 started=$SECONDS
    shift 2
    timeout --kill-after=20 "$budget" "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    local said="exit $status"
    [ "$status" -eq 124 ] && said="over its budget, stopped"
    echo "$name: $said after $((SECONDS - started)) s (budget $budget s); log $OUT/$name.log" | tee -a "$OUT/summary.txt"
}

if [ "$DEVICE" = cuda ]; then
    models=(t5-large) lengths=(512 150) batch=64 steps=6 shape=tinyllama-1.1b block=2048 kernels=(sdpa flex_attention)
else  # tiny: the embedded model, short sequences, FlexAttention's exactness only (no CPU backward)
    models=(embedded) lengths=(32 8) batch=2 steps=3 shape=tiny block=128 kernels=(sdpa)
fi

part benchmark 370 "$PYTHON" scripts/benchmark.py --suite gpu --models "${models[@]}" \
    --max_source_length "${lengths[0]}" --max_target_length "${lengths[1]}" --batch_size "$batch" \
    --steps "$steps" --dropout_rate 0 --time_budget_s 340 --out "$OUT/bench" --cases "bf16, FSDP1" \
    "bf16, no FSDP (one rank)" "bf16, FSDP1, t5_flex" "bf16, FSDP1, t5_flex, no activation checkpointing" \
    "bf16, no FSDP (one rank), t5_flex, no activation checkpointing"
part gpu_check 90 "$PYTHON" -m torch.distributed.run --nproc_per_node 1 --standalone scripts/gpu_check.py \
    --device "$DEVICE" --output "$OUT/gpu_check.json"
part smoke 50 "$PYTHON" -m torch.distributed.run --nproc_per_node 1 --standalone T5_training.py \
    --device "$DEVICE" --max_steps 20 --save_every_n_steps 10 --num_val_samples 32 --output_dir "$OUT/smoke"
part smoke_export 20 "$PYTHON" -c "import sys; from transformers import AutoModelForSeq2SeqLM as M; \
print(M.from_pretrained(sys.argv[1]).num_parameters(), 'parameters loaded')" "$OUT/smoke/hf_model"
part packing 45 "$PYTHON" scripts/packing_kernels.py --shape "$shape" --max_seq_len "$block" --batch_size 4 \
    --steps "$steps" --kernels "${kernels[@]}" --out "$OUT/packing.json"
echo "done: $OUT/summary.txt" | tee -a "$OUT/summary.txt"
