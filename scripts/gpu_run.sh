#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md, in stages, on a machine with a CUDA GPU and its own torch:
#   bash scripts/gpu_run.sh setup converge suite profile bench
# setup:    wheels from .whl/ (what that machine lacks) into /tmp/site, attnmt installed with -e,
#           data/multi30k from .gpu/multi30k when there is none.
# suite:    the whole test suite (tests/training/test_cuda.py runs there; other tests on the CPU, or on
#           the GPU where they take device auto), 6 workers, in the background of `converge`.
# converge: configs/multi30k_de_en_{transformer,rnn}_gpu.yaml trained, then test_2016_flickr
#           scored with beam 5 (cased, and lowercased -lc), best and averaged weights.
# profile:  torch.profiler over 10 steps of the base Transformer (bf16, 32k vocabulary).
# bench, bench-compiled, bench-small: scripts/bench.py train rows (bf16): the base Transformer
#           eager, then compiled; T and R.
# cuda-tests: tests/training/test_cuda.py and the modules that failed on the GPU machine before.
# Round 3 (issue 48), each step change a row of its own, the base Transformer compiled, bf16:
# r3-bench:   the step as before (prefetch off), + prefetch, + CUDA graphs (model kept in
#             runs/keep/base for decode-base); r3-accumulate: + accumulate 2;
# r3-small:   T and R (eager, prefetch on); r3-profile: torch.profiler over the compiled step;
# decode-t, decode-base: scripts/bench.py decode on CUDA, fp32 and bf16, greedy and beam 5,
#             batches of 1 (first 100 / 50 sentences), 64 and 1,024 sentences;
# ct2-probe:  whether CTranslate2's CUDA build could load there (it needs cuBLAS 12).
# teachers:   three more Multi30k T teachers (the GPU config, seeds 1, 2, 3, trained side by side
#             on the one GPU, with .gpu/t30's SentencePiece model), each scored on test; then
#             the ensemble of .gpu/t30 and the three, scored and distilling train.de (beam 5,
#             averaged weights) into $OUT/train.distilled_ens.en.
# Logs go to $OUT (default /tmp/gpu-out).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
TATOEBA=.gpu/tatoeba/fra-eng.tsv.gz
BASE=(--configs base --device cuda --synthetic 1000000 --tatoeba "$TATOEBA"
      --tokenizer .gpu/joint32k.model --set train.precision=bf16)
R3=(--configs base --device cuda --synthetic 300000 --tatoeba "$TATOEBA" --steps 100 --warmup 40
    --dev-sentences 100 --tokenizer .gpu/joint32k.model --set train.precision=bf16
    --set train.compile=true)
r3_row() { timeout 200 python3 scripts/bench.py train "${R3[@]}" "$@" | tee -a "$OUT/bench_r3.jsonl"; }
DECODE=(--device cuda --data data/multi30k --beams 1,5 --precision fp32,bf16)
decode() { timeout 150 python3 scripts/bench.py decode "${DECODE[@]}" "$@" | tee -a "$OUT/decode.jsonl"; }
suite_pid=""
for stage in "$@"; do
  echo "== $stage $(date +%T)"
  case $stage in
    setup)
      if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site .whl/*.whl || exit 1
      fi
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
      [ -e data/multi30k ] || { mkdir -p data && ln -s "$PWD/.gpu/multi30k" data/multi30k; }
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
      ;;
    suite)
      OMP_NUM_THREADS=2 python3 -m pytest -q -n 6 -p no:cacheprovider -W ignore \
        >"$OUT/suite.log" 2>&1 &
      suite_pid=$!
      ;;
    converge)
      for arch in transformer rnn; do
        dir=runs/gpu_$arch
        rm -rf "$dir"
        attnmt train --config "configs/multi30k_de_en_${arch}_gpu.yaml" --out "$dir" --quiet \
          >"$OUT/train_$arch.log" 2>&1
        tail -n 3 "$dir/train.log"
        ref=data/multi30k/test_2016_flickr.en.gz
        for w in best averaged; do
          hyp=$OUT/test_${arch}_$w.txt
          attnmt eval -m "$dir" --weights "$w" --beam 5 -s data/multi30k/test_2016_flickr.de.gz \
            -r $ref -o "$hyp" --json | sed "s/^/$arch $w cased /"
          attnmt eval --hyp "$hyp" -r $ref -lc --json | sed "s/^/$arch $w lc /"
        done
        cp "$dir/train_log.jsonl" "$OUT/train_log_$arch.jsonl"
      done
      ;;
    profile)
      python3 scripts/profile_train.py "${BASE[@]}" --synthetic 200000 --warmup 5 --profile-steps 10 \
        >"$OUT/profile_base.txt" 2>&1
      tail -n 2 "$OUT/profile_base.txt"
      ;;
    bench)
      python3 scripts/bench.py train "${BASE[@]}" --steps 120 --warmup 20 | tee -a "$OUT/bench.jsonl"
      ;;
    bench-compiled)
      python3 scripts/bench.py train "${BASE[@]}" --steps 150 --warmup 50 \
        --set train.compile=true | tee -a "$OUT/bench.jsonl"
      ;;
    bench-small)
      python3 scripts/bench.py train --configs T,R --device cuda --steps 300 --warmup 50 \
        --set train.precision=bf16 | tee -a "$OUT/bench.jsonl"
      ;;
    r3-bench)
      r3_row --set train.prefetch=false
      r3_row
      r3_row --set train.cuda_graphs=true --keep runs/keep
      ;;
    r3-accumulate)
      r3_row --set train.cuda_graphs=true --set train.accumulate=2
      ;;
    r3-small)
      timeout 120 python3 scripts/bench.py train --configs T,R --device cuda --steps 300 \
        --warmup 50 --set train.precision=bf16 | tee -a "$OUT/bench_r3.jsonl"
      ;;
    r3-profile)
      timeout 200 python3 scripts/profile_train.py "${R3[@]}" --synthetic 100000 --warmup 15 \
        --profile-steps 5 >"$OUT/profile_compiled.txt" 2>&1
      tail -n 2 "$OUT/profile_compiled.txt"
      ;;
    decode-t)
      decode --model .gpu/t_model --batch-sentences 64,1024 --runs 2
      decode --model .gpu/t_model --batch-sentences 1 --sentences 100 --runs 1
      ;;
    decode-base)
      decode --model runs/keep/base --batch-sentences 64,1024 --runs 1
      decode --model runs/keep/base --batch-sentences 1 --sentences 50 --runs 1
      ;;
    ct2-probe)
      ls /usr/local/cuda*/lib64/libcublas.so* 2>/dev/null | head -3
      python3 -c "import ctypes; ctypes.CDLL('libcublas.so.12'); print('cuBLAS 12: found')" \
        2>&1 | tail -n 1
      ;;
    teachers)
      ref=data/multi30k/test_2016_flickr.en.gz
      src=data/multi30k/test_2016_flickr.de.gz
      for seed in 1 2 3; do
        attnmt train --config configs/multi30k_de_en_transformer_gpu.yaml --out "runs/gpu_t$seed" \
          --quiet --set train.seed=$seed --set tokenizer.model=.gpu/t30/spm.model \
          >"$OUT/train_t$seed.log" 2>&1 &
      done
      wait
      members=(-m .gpu/t30)
      for seed in 1 2 3; do
        tail -n 2 "runs/gpu_t$seed/train.log"
        members+=(-m "runs/gpu_t$seed")
        attnmt eval -m "runs/gpu_t$seed" --weights averaged --beam 5 -s $src -r $ref --json \
          | sed "s/^/teacher $seed averaged /"
      done
      attnmt eval "${members[@]}" --weights averaged --beam 5 -s $src -r $ref --json \
        | sed "s/^/ensemble of 4 averaged /"
      teachers=(${members[@]//-m/--teacher})
      time attnmt distill "${teachers[@]}" --weights averaged -s data/multi30k/train.de.gz \
        -o "$OUT/train.distilled_ens.en"
      wc -l "$OUT/train.distilled_ens.en"
      ;;
    cuda-tests)
      lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-400
      OMP_NUM_THREADS=2 python3 -m pytest -q -n 6 -p no:cacheprovider -W ignore \
        tests/training/test_cuda.py tests/kernels/test_int8.py tests/decoding/test_search.py \
        tests/training/test_train.py::test_compiled_step_matches_eager >"$OUT/cuda_tests.log" 2>&1
      tail -n 15 "$OUT/cuda_tests.log"
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
if [ -n "$suite_pid" ]; then
  wait "$suite_pid"
  tail -n 25 "$OUT/suite.log"
fi
