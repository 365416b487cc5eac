#!/bin/bash
# Device call 1 (issue 30): the Triton sampler's tests compiled on the GPU, real vocabularies
# included, the engine's CUDA tests, and bench/verify.py against the native path. Carries the
# first part of the embedded GGUF to /tmp for bench/gpu/engine.sh (the file exceeds one call's
# 64 MiB). Run from the repository root: bash bench/gpu/sampler.sh
source bench/gpu/env.sh
mkdir -p /tmp/vsmodel && cp .gpu/part0 /tmp/vsmodel/
bash bench/gpu/tests.sh
timeout 110 python3 bench/verify.py --device cuda --batch 1 8 64 256 --k 3 5 --vocab 128256 \
    --dtype float32 bfloat16 --modes random greedy top-k50-p0.9 --json "$OUT/verify.json" 2>&1 | tee "$OUT/verify.log"
