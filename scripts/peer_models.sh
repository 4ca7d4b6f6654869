#!/usr/bin/env bash
# Train OpenNMT-py models of the same quality as attnmt's Multi30k models, for the decoding
# comparison (decode time follows output length, so the peers' 15-minute models do not do).
#
#   bash scripts/peer_models.sh T|R       # after `bash bench.sh setup && bash bench.sh prep`
#   cd ../shared/peers && bash bench.sh decode onmt Tq 1   # then 5, and Rq
#
# It renders the peers harness's own OpenNMT-py config (configs/onmt_{T,R}.yaml there) and
# changes only the schedule, to the one of configs/multi30k_de_en_{transformer,rnn}.yaml here:
#   Tq: Noam with warmup 800 and factor 0.4525 (peak 0.001 at step 800, then x sqrt(800/step),
#       = attnmt's inverse_sqrt with lr 0.001), gradient-norm clip 1, 1,000 steps
#   Rq: lr 0.001 (attnmt halves it on dev plateaus; OpenNMT-py has no such schedule here),
#       label smoothing 0.1, 2,000 steps (attnmt: 2,500)
# and writes models/onmt_{Tq,Rq}/ under $PEERS_RUN (default /tmp/peers-run), where
# `bench.sh decode onmt Tq|Rq BEAM` finds them.
set -euo pipefail
cfg=${1:?usage: peer_models.sh T|R}
here=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS:-$here/../shared/peers}
run=${PEERS_RUN:-${TMPDIR:-/tmp}/peers-run}
tag=onmt_${cfg}q
conf=$run/configs/$tag.yaml
mkdir -p "$run/configs" "$run/logs"
sed -e "s#@RUN@#$run#g" -e "s#models/onmt_$cfg/#models/$tag/#" "$peers/configs/onmt_$cfg.yaml" > "$conf"
case $cfg in
  T) steps=1000
     sed -i -e 's/^learning_rate: .*/learning_rate: 0.4525/' -e 's/^warmup_steps: .*/warmup_steps: 800/' \
       -e 's/^max_grad_norm: .*/max_grad_norm: 1/' "$conf" ;;
  R) steps=2000
     sed -i -e 's/^learning_rate: .*/learning_rate: 0.001/' -e 's/^label_smoothing: .*/label_smoothing: 0.1/' "$conf" ;;
  *) echo "peer_models.sh: config must be T or R, not '$cfg'" >&2; exit 2 ;;
esac
rm -rf "$run/models/$tag"; mkdir -p "$run/models/$tag"
echo "[$(date -u +%FT%TZ)] train $tag max_steps=$steps"
OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 "$run/venvs/onmt/bin/python" "$peers/onmt_wrap.py" train "$conf" \
  --budget-s 0 --max-steps "$steps" --steplog "$run/logs/$tag.train.steps.jsonl" \
  --summary "$run/logs/$tag.train.summary.json" > "$run/logs/$tag.train.out" 2>&1
tail -n 1 "$run/logs/$tag.train.out"
ls "$run/models/$tag"
