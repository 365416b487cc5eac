#!/bin/bash
# Device call of issue 42 (about 6 minutes on an H100, 2026-11-27): the GPU tests of the verify kernels and
# the engine, bench/verify.py at V = 128,256, and the engine rows of the issue's targets on a
# random-weight Llama 3.2 1B-shaped checkpoint (bf16, the embedded model's 49,152 tokens):
# batch 1 greedy 128 tokens, verispec with and without an n-gram drafter (which finds nothing on
# random text) against HF generate eager and HF static cache + torch.compile(reduce-overhead);
# the batch 64 GPU-busy share of a step (bench/step_profile.py). Results land in $OUT: run.log
# (every step's output and exit), gpu.txt and the JSON of verify, batch1 and step_profile
# (the device tool returns at most 8 files).
#
#   bash bench/gpu/prepare.sh              # here first: carried files, then the CPU dry run
#   bash bench/gpu/run.sh                  # on the device, carry [".whl", ".gpu"], timeout 560
#   bash bench/gpu/run.sh --dry-run        # every step on the CPU at tiny shapes
#   bash bench/gpu/run.sh tests batch1     # only the steps named (the checkpoint always)
set -o pipefail
DRY=0
if [ "$1" = "--dry-run" ]; then DRY=1; shift; fi
STEPS=" ${*:-tests verify topk_split batch1 step_profile} "
if [ $DRY = 1 ]; then
    PY=${PYTHON:-python3}
    export OUT=${OUT:-/tmp/issue42-dry} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    mkdir -p "$OUT"
    DEVICE=cpu SHAPE=tiny TOKENS=4 ROUNDS=1 VOCAB=2048 BATCH=4
else
    PY=python3
    source bench/gpu/env.sh
    DEVICE=cuda SHAPE=llama-3.2-1b TOKENS=128 ROUNDS=2 VOCAB=128256 BATCH=64
fi
CKPT=/tmp/ckpt-$SHAPE
step() {  # step NAME SECONDS COMMAND...: a cut-off or failed step does not stop the others
    local name=$1 limit=$2; shift 2
    [ "$name" = checkpoint ] || [[ "$STEPS" == *" $name "* ]] || return 0
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | grep -v "Loading weights\|Unrecognized keys" | tee -a "$OUT/run.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s" >> "$OUT/run.log"
}
step checkpoint 50 "$PY" bench/gpu/make_checkpoint.py --shape "$SHAPE" --out "$CKPT" \
    --tokenizer .gpu/tokenizer --device "$DEVICE"
step verify 50 "$PY" bench/verify.py --device "$DEVICE" --batch 1 64 --k 5 --vocab "$VOCAB" --dtype bfloat16 \
    --modes random greedy top-k50-p0.9 --reps 1 --json "$OUT/verify.json"
step topk_split 60 "$PY" bench/gpu/topk_split.py --device "$DEVICE" --vocab "$VOCAB" --json "$OUT/topk_split.json"
step batch1 210 "$PY" bench/gpu/batch1.py --model "$CKPT" --device "$DEVICE" --dtype bfloat16 \
    --tokens "$TOKENS" --rounds "$ROUNDS" --json "$OUT/batch1.json"
step step_profile 80 "$PY" bench/step_profile.py --device "$DEVICE" --model "$CKPT" --dtype bfloat16 \
    --batch 1 "$BATCH" --draft none ngram --rounds 1 --max-tokens 32 --json "$OUT/step_profile.json"
TESTS="tests/sample/test_triton.py tests/sample/test_triton_split_rows.py tests/engine/test_cuda.py tests/engine/test_greedy_path.py
    tests/model/test_row_attention.py"
if [ "$DEVICE" = cuda ]; then
    # -v: a test's verdict is logged as it ends, so a step cut off still names what failed
    step tests 120 env OMP_NUM_THREADS=1 "$PY" -m pytest -p no:cacheprovider -o addopts= -n 12 -v \
        --timeout 100 -rfE $TESTS
else  # the interpreter runs these in make test; here only that they collect
    step tests 120 "$PY" -m pytest -p no:cacheprovider -o addopts= -q --collect-only $TESTS
fi
grep "^== .*: exit" "$OUT/run.log"
