#!/bin/bash
# The GPU test run of bench/gpu/sampler.sh alone, verbose and with a per-test limit, so that a
# run cut short still says which tests passed. Run from the repository root: bash bench/gpu/tests.sh
source bench/gpu/env.sh
timeout 280 python3 -m pytest -p no:cacheprovider -o addopts= -n 16 -v --timeout 60 -rfE --durations=15 \
    tests/engine/test_cuda.py tests/sample/test_triton.py tests/sample/test_rejection.py tests/model/test_llama.py \
    2>&1 | grep -v "Benchmark\|warner" | tee "$OUT/pytest.log" | grep -v PASSED | tail -60
grep -c PASSED "$OUT/pytest.log"
