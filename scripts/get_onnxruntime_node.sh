#!/usr/bin/env bash
# Install onnxruntime-node (from the npm registry) for the test that runs an ONNX export's
# JavaScript module (search.js) in Node: bash scripts/get_onnxruntime_node.sh [DIR]
# (default .cache/onnxruntime-node; the test reads ATTNMT_ONNXRUNTIME_NODE). --ignore-scripts:
# its install script fetches CUDA libraries from nuget.org; the CPU binaries come in the package.
set -euo pipefail
version=1.30.0  # the same onnxruntime as the web export's runtime (scripts/get_web_runtime.py)
dir="${1:-.cache/onnxruntime-node}"
mkdir -p "$dir"
cd "$dir"
[ -f package.json ] || npm init -y >/dev/null
npm install --no-audit --no-fund --ignore-scripts --silent "onnxruntime-node@$version"
echo "$(pwd): onnxruntime-node $version"
