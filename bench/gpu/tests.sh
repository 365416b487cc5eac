#!/bin/bash
# The GPU test run of bench/gpu/sampler.sh alone, verbose and with a per-test limit, so that a
# run cut short still says which tests passed. Run from the repository root: bash bench/gpu/tests.sh
# 8 processes of 2 threads: 16 processes with torch's default threads on 16 cores timed out the
# tests that compute an HF reference on the host.
source bench/gpu/env.sh
OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout 280 python3 -m pytest -p no:cacheprovider -o addopts= -n 8 -v \
    --timeout 120 -rfE --durations=15 \
    tests/engine/test_cuda.py tests/sample/test_triton.py tests/sample/test_rejection.py \
    tests/engine/test_greedy_path.py tests/model/test_llama.py tests/model/test_row_attention.py \
    2>&1 | grep -v "Benchmark\|warner" | tee "$OUT/pytest.log" | grep -v PASSED | tail -60
grep -c PASSED "$OUT/pytest.log"
