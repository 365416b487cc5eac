#!/bin/bash
# Device call 2 (issue 30), right after bench/gpu/sampler.sh on the same warm machine: joins the
# embedded GGUF from its two carried parts, then bench/e2e.py and bench/step_profile.py on CUDA.
# Run from the repository root: bash bench/gpu/engine.sh
source bench/gpu/env.sh
MODEL=/tmp/vsmodel/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/vsmodel/part0 .gpu/part1 > "$MODEL" || exit 1
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $MODEL" | sha256sum -c || exit 1
timeout 230 python3 bench/e2e.py --device cuda --model "$MODEL" --dtype bfloat16 float32 --batch 16 64 \
    --json "$OUT/e2e.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/e2e.log"
timeout 90 python3 bench/step_profile.py --device cuda --model "$MODEL" --dtype bfloat16 --batch 1 16 64 \
    --draft none ngram --json "$OUT/step_profile.json" 2>&1 | tee "$OUT/step_profile.log"
