#!/bin/bash
# Run HERE (the host, not the device) before bench/gpu/run.sh's device call: what that call
# carries, in folders git ignores: .whl (the gguf wheel the device image lacks; bench/gpu/env.sh
# installs it) and .gpu/tokenizer (the embedded model's tokenizer, which the random-weight
# checkpoints of bench/gpu/make_checkpoint.py use: the GGUF it comes from stays here). Then the
# CPU dry run of the whole device script, so that the device minutes go to no typo.
# Run from the repository root: bash bench/gpu/prepare.sh   (then carry [".whl", ".gpu"])
set -e
PY=${PYTHON:-.venv/bin/python}
EXCLUDE=$(git rev-parse --git-common-dir)/info/exclude
mkdir -p "$(dirname "$EXCLUDE")"
for d in /.whl/ /.gpu/; do grep -qxF "$d" "$EXCLUDE" 2>/dev/null || echo "$d" >> "$EXCLUDE"; done
GGUF=$(grep -E '^gguf==' requirements.txt)
ls .whl/gguf-*.whl >/dev/null 2>&1 || "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl "$GGUF"
mkdir -p .gpu/tokenizer
"$PY" -c "
import shutil; from verispec.model.loader import converted_checkpoint_dir
d = converted_checkpoint_dir(progress=False)
for name in ('tokenizer.json', 'tokenizer_config.json'): shutil.copy(d / name, '.gpu/tokenizer/' + name)"
PYTHON="$PY" bash bench/gpu/run.sh --dry-run
