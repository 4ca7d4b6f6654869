#!/usr/bin/env bash
# Install transformers.js (@huggingface/transformers, from the npm registry) for the test that
# loads `attnmt export --format huggingface --onnx` with it: bash scripts/get_transformers_js.sh [DIR]
# (default .cache/transformers-js; the test reads ATTNMT_TRANSFORMERS_JS). --ignore-scripts:
# onnxruntime-node's install script fetches CUDA libraries from nuget.org; its CPU binaries
# come in the package itself.
set -euo pipefail
dir="${1:-.cache/transformers-js}"
mkdir -p "$dir"
cd "$dir"
[ -f package.json ] || npm init -y >/dev/null
npm install --no-audit --no-fund --ignore-scripts --silent @huggingface/transformers@4.3.2
echo "$(pwd): @huggingface/transformers 4.3.2"
