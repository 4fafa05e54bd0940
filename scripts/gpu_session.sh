#!/usr/bin/env bash
# What to measure on one GPU lent for 15 minutes of device time (2-3 of them the machine's start-up), in one
# command, most wanted first: each part under a time budget of its own (one slow part cannot eat the others),
# the budgets summing to SESSION_S seconds (a part that ends early leaves its time to the later ones; one whose
# budget is more than what is left gets what is left, and is skipped when that is under 30 s); its output and log
# under $OUT, one summary line per part in $OUT/summary.txt, the benchmark parts' tables in $OUT/results.md.
# From the repository's root:
#
#     OUT=/somewhere bash scripts/gpu_session.sh            # one GPU: at most SESSION_S=630 s of parts
#     DEVICE=cpu OUT=/tmp/dry bash scripts/gpu_session.sh   # the same parts at tiny scale (a dry run on a machine
#                                                           # without a GPU; the benchmark takes a GPU where it finds one)
#
# WHEELS: a folder of wheels to install first (pip --no-deps --no-index), for a machine that reaches no package
# index: torchao for the float8 part, liger-kernel for the HF Trainer peer with Liger's kernels (`pip download
# torchao==0.18.0 liger-kernel --no-deps -d wheels` where an index is reachable; the repository's wheels/ is
# git-ignored, for the device tool's carry). Without them, float8 is refused (its part fails with the pip line)
# and the Liger peer is listed as not run.
#
# OUT (default /tmp/gpu_session) must be empty or new: a demo run refuses a folder that holds one. The random-weight
# model folders (GBs on a GPU) go to MODELS_DIR (default /tmp/gpu_session_models, outside OUT), made once and read
# by every part. The exit status is the number of parts that did not end well (a part skipped for want of time
# counts; a case this machine cannot run, listed under its table, does not).
#
# 1. causal: scripts/benchmark.py --suite gpu_causal, a TinyLlama-1.1B-shaped model (random weights) on packed
#    2048-token blocks of whole texts (bfd), bf16, 8 blocks a step: SDPA's dense document mask, then HF's Trainer
#    on the same rows (flattened, eager; Liger where liger_kernel imports; torch_compile), then flex_attention,
#    compiled, and the fastest form (chunked loss, no activation checkpointing, no FSDP);
# 2. t5: --suite gpu, t5-large, 512/150 tokens, batch 64, dropout 0: FSDP1, then the stock HF model (the peer),
#    then one rank without FSDP with t5_flex and no activation checkpointing, eager and compiled;
# 3. causal_levers: the levers between (chunked loss alone, per-op checkpointing, no checkpointing under FSDP1);
# 4. gpu_check: backends, host syncs, t5_flex's FlexAttention backward, one rank without FSDP, a sharded save and
#    load, generation's all-gathers;
# 5. smoke: the embedded demo on the GPU for 20 steps, saving twice, its evaluation (32 rows), its export loaded;
# 6. float8: the fastest form with --float8 true.
# Compiling costs tens of seconds a case on a GPU (inductor's cache, kept on the machine, shortens the later
# cases that share a graph): the budgets allow for it (docs/throughput.md: "Decoder-only, on one GPU").
# World size 1: NCCL refuses two ranks on one GPU, so FSDP1 runs NO_SHARD and FSDP2 skips its collectives.
set -u
OUT=$(realpath -m "${OUT:-/tmp/gpu_session}")  # before the cd: a relative OUT is the caller's
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python}
MODELS_DIR=${MODELS_DIR:-/tmp/gpu_session_models}
export PYTHONUNBUFFERED=1
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
    echo "OUT=$OUT is not empty: give a new folder (a demo run refuses one that holds a run)" >&2
    exit 2
fi
mkdir -p "$OUT" "$MODELS_DIR"
failed=0

if [ "$DEVICE" = cuda ]; then
    session_s=${SESSION_S:-630}  # 15 minutes less the start-up and the files' way back
    llama=tinyllama-1.1b block=2048 blocks=8 causal_steps=12
    t5=(--models t5-large --max_source_length 512 --max_target_length 150 --batch_size 64 --steps 6)
    causal_budget=220 t5_budget=130 levers_budget=90 check_budget=50 smoke_budget=45 export_budget=15
    float8_budget=80  # 630 s in all: no part's budget counts on another's leftovers
else  # tiny: the same parts at CPU scale; the GPU-only cases are skipped and listed
    session_s=${SESSION_S:-1800}  # 2 CPU cores shared with other work take minutes where a GPU takes seconds
    llama=llama-tiny block=256 blocks=2 causal_steps=5
    t5=(--models embedded --max_source_length 32 --max_target_length 8 --batch_size 2 --steps 3)
    causal_budget=300 t5_budget=300 levers_budget=120 check_budget=240 smoke_budget=300 export_budget=60
    float8_budget=120
fi
deadline=$((SECONDS + session_s))

part() {  # part NAME BUDGET_S COMMAND...: run it under its budget or the session's time left, whichever is less
    local name=$1 budget=$2 started=$SECONDS  # (5 s more to die after SIGTERM), log to $OUT/NAME.log, say how it
    shift 2                                    # ended; 0 if it ended well
    local left=$((deadline - SECONDS))
    if [ "$left" -lt "$budget" ]; then
        if [ "$left" -lt 30 ]; then
            echo "$name: skipped: the session's time is spent" | tee -a "$OUT/summary.txt"
            failed=$((failed + 1))
            return 1
        fi
        budget=$left
    fi
    # ${BENCH_BUDGET} inside a benchmark's own command: its --time_budget_s, 40 s inside the part's budget,
    # time for the benchmark to stop a case it cut off (torchrun's grace for its ranks is 30 s)
    BENCH_BUDGET=$((budget - 40)) timeout --kill-after=5 "$budget" "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    local said="exit $status"
    case $status in
        124 | 137) said="over its budget, stopped" ;;
    esac
    echo "$name: $said after $((SECONDS - started)) s (budget $budget s); log $OUT/$name.log" | tee -a "$OUT/summary.txt"
    [ "$status" -eq 0 ] || failed=$((failed + 1))
    return "$status"
}

# scripts/benchmark.py with its own --time_budget_s: BENCH_BUDGET, which part sets
bench=(bash -c '"$@" --time_budget_s "$BENCH_BUDGET"' benchmark "$PYTHON" scripts/benchmark.py --models_dir "$MODELS_DIR")
if [ -n "${WHEELS:-}" ]; then
    "$PYTHON" -m pip install --no-deps --no-index "$WHEELS"/*.whl > "$OUT/wheels.log" 2>&1 ||
        echo "wheels: not installed ($OUT/wheels.log)" | tee -a "$OUT/summary.txt"
fi
causal=(--models "$llama" --max_seq_len "$block" --batch_size "$blocks" --steps "$causal_steps")
fastest="bf16, flex_attention, compiled, chunked loss, no checkpointing, no FSDP"
"$PYTHON" -c "import datetime, os, sys, torch, transformers; print('date', datetime.date.today(), '|',
torch.cuda.get_device_name() if torch.cuda.is_available() else f'cpu, {os.cpu_count()} cores', '| torch',
torch.__version__, '| transformers', transformers.__version__, '| command:', ' '.join(sys.argv[1:]))" \
    "DEVICE=$DEVICE bash scripts/gpu_session.sh" > "$OUT/environment.txt" 2>&1
part causal "$causal_budget" "${bench[@]}" --suite gpu_causal --out "$OUT/causal" "${causal[@]}" --cases \
    "bf16, SDPA (dense document mask)" "bf16, flex_attention" "bf16, flex_attention, compiled" "$fastest"
part t5 "$t5_budget" "${bench[@]}" --suite gpu --out "$OUT/t5" "${t5[@]}" --dropout_rate 0 --cases "bf16, FSDP1" \
    "bf16, no FSDP (one rank), t5_flex, no activation checkpointing" \
    "bf16, no FSDP (one rank), compiled blocks, t5_flex, no activation checkpointing"
part causal_levers "$levers_budget" "${bench[@]}" --suite gpu_causal --out "$OUT/causal_levers" "${causal[@]}" \
    --peers --cases \
    "bf16, flex_attention, compiled, chunked loss" \
    "bf16, flex_attention, chunked loss, per-op checkpointing" \
    "bf16, flex_attention, compiled, chunked loss, no checkpointing"
part gpu_check "$check_budget" "$PYTHON" -m torch.distributed.run --nproc_per_node 1 --standalone \
    scripts/gpu_check.py --device "$DEVICE" --output "$OUT/gpu_check.json"
part smoke "$smoke_budget" "$PYTHON" -m torch.distributed.run --nproc_per_node 1 --standalone T5_training.py \
    --device "$DEVICE" --max_steps 20 --save_every_n_steps 10 --num_val_samples 32 --output_dir "$OUT/smoke" &&
    part smoke_export "$export_budget" "$PYTHON" -c "import sys; from transformers import AutoModelForSeq2SeqLM as M; \
print(M.from_pretrained(sys.argv[1]).num_parameters(), 'parameters loaded')" "$OUT/smoke/hf_model"
part float8 "$float8_budget" "${bench[@]}" --suite gpu_causal --out "$OUT/float8" "${causal[@]}" --peers \
    --cases "$fastest, float8"
for name in causal t5 causal_levers float8; do  # the measured tables, in the parts' order
    [ -f "$OUT/$name/results.md" ] && { echo "## $name"; echo; cat "$OUT/$name/results.md"; echo; } >> "$OUT/results.md"
done
echo "done, $failed part(s) not ending well: $OUT/summary.txt, $OUT/results.md ($(cat "$OUT/environment.txt"))" |
    tee -a "$OUT/summary.txt"
exit "$failed"
