#!/usr/bin/env bash
# Quickstart: build a German->English number-words corpus, train a small Transformer on it,
# translate a few test sentences and print the test BLEU as the last line.
#   scripts/quickstart.sh [OUT_DIR]        (default: runs/quickstart)
# ATTNMT_THREADS=N: train with N threads (default 0: as many as other processes leave free).
set -euo pipefail
out=${1:-runs/quickstart}
here=$(cd "$(dirname "$0")" && pwd)
data="$out/data"
start=$(date +%s)

python "$here/make_numbers.py" "$data"
attnmt train --config "$here/../configs/quickstart.yaml" --out "$out/model" --overwrite \
  --set train.threads="${ATTNMT_THREADS:-0}" \
  --set data.train.src="$data/train.de" --set data.train.tgt="$data/train.en" \
  --set data.dev.src="$data/dev.de" --set data.dev.tgt="$data/dev.en"

echo "--- a few test translations (source | model output | reference)"
head -n 5 "$data/test.de" > "$out/sample.de"
attnmt translate --model "$out/model" --input "$out/sample.de" --output "$out/sample.hyp"
paste -d'|' "$out/sample.de" "$out/sample.hyp" <(head -n 5 "$data/test.en") | sed 's/|/ | /g'

attnmt eval --model "$out/model" --src "$data/test.de" --ref "$data/test.en" \
  --output "$out/test.hyp" --json > "$out/test_scores.json"
echo "wall time: $(( $(date +%s) - start )) s"
python -c "import json,sys; s=json.load(open(sys.argv[1])); print(s['bleu_signature']); print(f\"test BLEU = {s['bleu']:.2f}\")" "$out/test_scores.json"
