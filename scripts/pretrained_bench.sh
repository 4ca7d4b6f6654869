#!/usr/bin/env bash
# Pretrained models in and out, measured (docs/benchmarks.md "Importing a Marian model"):
#   marian [OUT [NPZ]]  a Marian model trained by Marian (../shared/peers: bench.sh setup marian tools, prep,
#            train marian T SECS) imported into attnmt; test_2016_flickr BLEU of marian-decoder
#            and attnmt, greedy and beam 5 (raw log-probability ranking in both, alpha 0, the
#            same length caps: one sentence a batch), identical lines; and sentences/s at 1 and
#            2 threads (batches of 64), attnmt fp32 and int8 against marian-decoder.
#   finetune MODEL OUT MIN   fine-tune an attnmt model directory on Multi30k for MIN minutes;
#            test BLEU (beam 5) before and after.
#   roundtrip SRC OUT        export an attnmt model as a MarianMTModel, import it back, translate
#            the test set with both (the same lines?).
# Run one at a time, nothing else running. Needs: python scripts/get_multi30k.py, the venv.
set -euo pipefail
PEERS=${PEERS:-../shared/peers}
RUN=${PEERS_RUN:-/tmp/peers-run}
MARIAN="$RUN/venvs/marian/bin/python -m pymarian"
SPM=$RUN/data/spm
TEST_DE=data/multi30k/test_2016_flickr.de.gz
TEST_EN=data/multi30k/test_2016_flickr.en.gz
bleu() {  # hypothesis file -> BLEU and sacreBLEU's signature
  python -c "import sacrebleu, gzip, sys; b = sacrebleu.BLEU(); h = open(sys.argv[1]).read().splitlines(); \
r = gzip.open('$TEST_EN', 'rt').read().splitlines(); print(f'{b.corpus_score(h, [r]).score:.2f} ({b.get_signature()})')" "$1"
}
unpiece() {  # Marian's output pieces -> text
  python -c "import sentencepiece as s, sys; sp = s.SentencePieceProcessor(model_file=sys.argv[1]); \
print('\n'.join(sp.decode_pieces(l.split()) for l in open(sys.argv[2]).read().splitlines()))" "$1" "$2"
}

case "${1:-}" in
marian)
  out=${2:-runs/marian_import} model=${3:-$RUN/models/marian_T/model.npz}
  attnmt import "$model" --out "$out" --spm "$SPM/spm8k.model" --force
  # Equal outputs: one sentence a batch (Marian caps a batch at ceil(factor x its widest source
  # + 1); attnmt's import caps each sentence so), Marian's default factor 3, raw log-probability.
  for beam in 1 5; do
    $MARIAN decode -m "$model" -v "$SPM/vocab.marian.txt" "$SPM/vocab.marian.txt" \
      -i "$SPM/test.de" -o /tmp/marian.eq.b$beam --cpu-threads 2 --beam-size $beam \
      --normalize 0 --word-penalty 0 --mini-batch 1 --maxi-batch 1 --max-length-factor 3 \
      --quiet-translation --quiet
    unpiece "$SPM/spm8k.model" /tmp/marian.eq.b$beam > /tmp/marian.eq.b$beam.txt
    attnmt translate -m "$out" -i $TEST_DE -o /tmp/attnmt.eq.b$beam --beam $beam --length-penalty 0
    echo "beam $beam, one sentence a batch: marian-decoder BLEU $(bleu /tmp/marian.eq.b$beam.txt)"
    echo "beam $beam, one sentence a batch: attnmt BLEU $(bleu /tmp/attnmt.eq.b$beam)"
    echo "beam $beam: $(paste -d '\t' /tmp/marian.eq.b$beam.txt /tmp/attnmt.eq.b$beam | awk -F'\t' '$1 == $2' | wc -l) of 1000 lines identical"
  done
  # Speed: batches of 64 sentences in both, whole process (model load included).
  for beam in 1 5; do
    for threads in 1 2; do
      start=$(date +%s.%N)
      $MARIAN decode -m "$model" -v "$SPM/vocab.marian.txt" "$SPM/vocab.marian.txt" \
        -i "$SPM/test.de" -o /tmp/marian.b$beam --cpu-threads $threads --beam-size $beam \
        --normalize 0 --word-penalty 0 --mini-batch 64 --maxi-batch 1 --max-length-factor 3 \
        --quiet-translation --quiet
      end=$(date +%s.%N)
      echo "marian-decoder beam $beam threads $threads: $(python -c "print(round(1000 / ($end - $start), 1))") sent/s (process, model load included)"
    done
    for precision in fp32 int8; do
      for threads in 1 2; do
        start=$(date +%s.%N)
        OMP_NUM_THREADS=$threads attnmt translate -m "$out" -i $TEST_DE -o /tmp/attnmt.b$beam.$precision \
          --beam $beam --length-penalty 0 --precision $precision --device cpu
        end=$(date +%s.%N)
        echo "attnmt $precision beam $beam threads $threads: $(python -c "print(round(1000 / ($end - $start), 1))") sent/s (process, model load included)"
      done
      echo "attnmt $precision beam $beam BLEU: $(bleu /tmp/attnmt.b$beam.$precision)"
    done
  done
  ;;
finetune)
  src=$2 out=$3 minutes=$4
  cat > /tmp/finetune.yaml <<EOF
data:
  train: {src: data/multi30k/train.de.gz, tgt: data/multi30k/train.en.gz}
  dev: {src: data/multi30k/val.de.gz, tgt: data/multi30k/val.en.gz}
train:
  init_from: $src
  time_budget: ${minutes}m
  lr_schedule: budget
  lr: 0.0002
  warmup_steps: 50
  batch_tokens: 4096
  eval_every: 200
  label_smoothing: 0.1
EOF
  attnmt eval -m "$src" -s $TEST_DE -r $TEST_EN --beam 5
  attnmt train -c /tmp/finetune.yaml --out "$out" --quiet
  attnmt eval -m "$out" -s $TEST_DE -r $TEST_EN --beam 5
  ;;
roundtrip)
  src=$2 out=$3
  attnmt export "$src" "$out.hf" --format huggingface --force
  attnmt import "$out.hf" --out "$out" --force
  attnmt translate -m "$src" -i $TEST_DE -o /tmp/rt.before
  attnmt translate -m "$out" -i $TEST_DE -o /tmp/rt.after
  echo "round trip: $(paste -d '\t' /tmp/rt.before /tmp/rt.after | awk -F'\t' '$1 == $2' | wc -l) of 1000 lines identical"
  ;;
*)
  sed -n '2,13p' "$0"; exit 2 ;;
esac
