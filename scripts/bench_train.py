"""`scripts/bench.py train`: training speed of a config, on the CPU or a CUDA GPU.

Trains each config under test for --steps steps with `attnmt train` (one child process per
config) and prints one JSON line per config. The configs:
  T     Transformer 3+3, d256, 4 heads, FF 1024, ~4,096-token batches (as ../shared/peers)
  R     bi-GRU 256 per direction + GRU decoder with Bahdanau attention, 64 sentences a batch
  base  Transformer 6+6, d512, 8 heads, FF 2048 (Vaswani et al.'s base), --batch-tokens
        target tokens a batch (default 32,768)
on Multi30k de-en (--data), or with --synthetic N on N pairs built from Tatoeba's en-fr pairs
(each one to three random pairs joined, seeded: scripts/bench_data.py), so that a fast GPU
does not see a pair twice within the run. --vocab sets the joint SentencePiece vocabulary
(default 8,000), --tokenizer an existing SentencePiece model instead of training one.

Each row: tokens_per_s (target tokens a second, median over the steps after --warmup),
tokens_per_s_wall (their sum over the summed step times), src_tokens_per_s, padding (share of
padded source + target positions), model_gflops, peak_gflops and peak_share (the MFU),
max_rss_mb, and dev_loss (on the first --dev-sentences dev pairs after the last step: compares
precisions or code changes after the same steps).

Model FLOPs. A Transformer's are counted from its matmuls, per real (non-pad) token, 2 FLOPs a
multiply-add and 3 passes (forward, and backward's two products): each source token through
the encoder (4d² attention + 2·d·ff feed-forward per layer) and through each decoder layer's
cross-attention keys and values (2d²), each target token through the decoder (4d² self- +
2d² cross-attention queries and output, 2·d·ff) and the output layer (d·V). The attention
scores themselves (2·d·length per token and layer, under 3 % at Multi30k's lengths) and
everything that is not a matmul are left out, as are padded positions. R's are 6 × parameters ×
target tokens. The peak: on a GPU, its datasheet's dense rate in the run's precision
(H100 SXM and H200: 989.4 TFLOP/s in bf16/fp16, 494.7 in tf32); on the CPU, the best square-
matmul rate measured in this process with the same threads (fp32: the better of BLAS and
oneDNN, in peak_gflops_by_library).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from bench_data import TATOEBA, make_corpus

from attnmt.config import apply_override
from attnmt.data.text import read_lines
from attnmt.device import PRECISION_DTYPES, resolve_device, resolve_precision
from attnmt.kernels import matmul

# T and R match ../shared/peers/configs/onmt_{T,R}.yaml (see the README).
TRAIN_CONFIGS: dict[str, dict[str, Any]] = {
    "T": {
        "model": {
            "arch": "transformer", "hidden_size": 256, "heads": 4, "ff_size": 1024,
            "enc_layers": 3, "dec_layers": 3, "dropout": 0.1, "attention_dropout": 0.1,
            "norm": "pre", "tie_embeddings": True,
        },
        "train": {
            "batch_tokens": 4096, "lr": 0.001, "lr_schedule": "inverse_sqrt",
            "warmup_steps": 800, "label_smoothing": 0.1, "adam_betas": [0.9, 0.98],
        },
    },
    "R": {
        "model": {
            "arch": "rnn", "emb_size": 256, "hidden_size": 256, "enc_layers": 1,
            "dec_layers": 1, "attention": "bahdanau", "dropout": 0.2, "tie_embeddings": False,
        },
        "train": {
            "batch_tokens": 100_000, "batch_sentences": 64, "lr": 0.0003,
            "lr_schedule": "constant", "warmup_steps": 0, "label_smoothing": 0.0,
            "clip_grad_norm": 5.0, "adam_betas": [0.9, 0.999],
        },
    },
    "base": {
        "model": {
            "arch": "transformer", "hidden_size": 512, "heads": 8, "ff_size": 2048,
            "enc_layers": 6, "dec_layers": 6, "dropout": 0.1, "attention_dropout": 0.1,
            "norm": "pre", "tie_embeddings": True,
        },
        "train": {
            "batch_tokens": 32768, "lr": 0.0007, "lr_schedule": "inverse_sqrt",
            "warmup_steps": 4000, "label_smoothing": 0.1, "adam_betas": [0.9, 0.98],
        },
    },
}  # fmt: skip

# Dense matmul peaks (TFLOP/s) from the datasheets, by GPU name and precision: H100 SXM5 and
# H200 (the same tensor cores), A100 SXM4. fp32 runs use TF32 only where torch allows it.
GPU_PEAK_TFLOPS = {
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
}


def transformer_flops(
    model: dict[str, Any], vocab: int, src_tokens: float, tgt_tokens: float
) -> float:
    """Training FLOPs of a Transformer's matmuls for the given real tokens (module docstring)."""
    d, ff, n_enc, n_dec = (
        model["hidden_size"],
        model["ff_size"],
        model["enc_layers"],
        model["dec_layers"],
    )
    per_src = n_enc * (4 * d * d + 2 * d * ff) + n_dec * 2 * d * d
    per_tgt = n_dec * (6 * d * d + 2 * d * ff) + d * vocab
    return 6.0 * (per_src * src_tokens + per_tgt * tgt_tokens)


def matmul_peak_gflops(
    threads: int,
    dtype: torch.dtype = torch.float32,
    sizes: tuple[int, ...] = (1024, 2048),
    reps: int = 5,
) -> float:
    """Best GFLOP/s of square `dtype` matmuls on the CPU with `threads` threads, through the
    backend in use (attnmt.matmul: the BLAS or oneDNN)."""
    torch.set_num_threads(threads)
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        matmul.mm(a, b)  # warm-up
        for _ in range(reps):
            start = time.perf_counter()
            matmul.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best


def peaks(device: torch.device, precision: str, threads: int) -> dict[str, float]:
    """GFLOP/s the run's matmuls could reach, by source (module docstring)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = next(
            (v for k, v in GPU_PEAK_TFLOPS.items() if k in name and "PCIe" not in name), None
        )
        if known is None:
            raise SystemExit(f"bench train: no datasheet peak known for {name}")
        return {f"datasheet {name}": 1000 * known[precision]}
    dtype = PRECISION_DTYPES.get(precision, torch.float32)
    found: dict[str, float] = {}
    for lib in ("blas", "onednn") if dtype == torch.float32 else ("blas",):
        with matmul.matmul_backend(lib) as used:
            found[used] = max(found.get(used, 0.0), matmul_peak_gflops(threads, dtype))
    return found


def data_section(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Multi30k de-en (--data), or --synthetic pairs from Tatoeba en-fr; dev cut to
    --dev-sentences pairs."""
    if args.synthetic:
        files = make_corpus(args.tatoeba, args.synthetic, work / "corpus")
        train = {"src": str(files["train_en"]), "tgt": str(files["train_fr"])}
        dev_src, dev_tgt = files["dev_en"], files["dev_fr"]
    else:
        data = args.data.absolute()
        train = {"src": str(data / "train.de.gz"), "tgt": str(data / "train.en.gz")}
        dev_src, dev_tgt = data / "val.de.gz", data / "val.en.gz"
    n_dev = args.dev_sentences
    (work / "dev.src").write_text("\n".join(read_lines(dev_src)[:n_dev]) + "\n")
    (work / "dev.tgt").write_text("\n".join(read_lines(dev_tgt)[:n_dev]) + "\n")
    dev = {"src": str(work / "dev.src"), "tgt": str(work / "dev.tgt")}
    return {"train": train, "dev": dev, "max_len": 100}


def train_config(args: argparse.Namespace, name: str, work: Path) -> dict[str, Any]:
    tokenizer: dict[str, Any] = {"vocab_size": args.vocab, "joint": True}
    if args.tokenizer:
        tokenizer = {"model": str(args.tokenizer.absolute()), "joint": True}
    cfg = {
        "data": data_section(args, work),
        "tokenizer": tokenizer,
        "model": TRAIN_CONFIGS[name]["model"],
        "train": {
            **TRAIN_CONFIGS[name]["train"],
            "max_steps": args.steps,
            "eval_every": args.steps + 1,
            "log_every": 1,
            "threads": args.threads // args.procs,
            "device": args.device,
            "seed": 1234,
        },
    }
    if name == "base" and args.batch_tokens:
        cfg["train"]["batch_tokens"] = args.batch_tokens
    # R's batches are counted in sentences (its token limit is only a cap), T's in tokens.
    per_rank = "batch_sentences" if "batch_sentences" in cfg["train"] else "batch_tokens"
    cfg["train"][per_rank] //= args.procs
    for assignment in args.set:
        apply_override(cfg, assignment)
    return cfg


def run_child(args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], Any]:
    """`attnmt train` on work/config.yaml in a child process: its events and resource usage."""
    cmd = [sys.executable, "-m", "attnmt", "train", "--config", str(work / "config.yaml")]
    if args.procs > 1:
        # Data parallel over processes (DDP): each rank takes 1/procs of a batch and of the
        # threads, so an optimizer step sees the same tokens.
        run = ["-m", "torch.distributed.run", "--standalone"]
        cmd[1:1] = [*run, "--nproc_per_node", str(args.procs)]
    cmd += ["--out", str(work / "model"), "--quiet"]  # --set is in the config already
    env = dict(os.environ)
    if args.threads:  # 0: the trainer's own choice (train.threads 0)
        env["OMP_NUM_THREADS"] = str(args.threads // args.procs)
    child = subprocess.Popen(cmd, env=env)
    # A benchmark stopped by `timeout` (SIGTERM) stops its trainer too: on the GPU machine a
    # trainer left running held the pipe of `| tee` open, so the stage never ended.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        _, status, usage = os.wait4(child.pid, 0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if status != 0:
        raise SystemExit(f"bench train: attnmt train failed ({status})")
    lines = (work / "model" / "train_log.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], usage


def bench_train(args: argparse.Namespace) -> None:
    device = resolve_device(args.device)
    for name in args.configs:
        with tempfile.TemporaryDirectory(prefix=f"attnmt-bench-{name}-") as tmp:
            work = Path(tmp)
            cfg = train_config(args, name, work)
            (work / "config.yaml").write_text(yaml.safe_dump(cfg))
            precision = resolve_precision(cfg["train"].get("precision", "fp32"), device)
            peak_by_source = peaks(device, precision, args.threads or torch.get_num_threads())
            events, usage = run_child(args, work)
            if args.keep:  # the trained model directory, for decoding benchmarks
                shutil.copytree(work / "model", args.keep / name, dirs_exist_ok=True)
        print(
            json.dumps(row(args, name, cfg, events, usage, precision, peak_by_source)), flush=True
        )


def row(
    args: argparse.Namespace,
    name: str,
    cfg: dict[str, Any],
    events: list[dict[str, Any]],
    usage: Any,
    precision: str,
    peak_by_source: dict[str, float],
) -> dict[str, Any]:
    """One config's JSON row from its run's events (module docstring)."""
    model_event = next(e for e in events if e["event"] == "model")
    data_event = next(e for e in events if e["event"] == "data")
    steps = [e for e in events if e["event"] == "train" and e["step"] > args.warmup]
    rates = [e["tokens"] / e["seconds"] for e in steps]
    tokens = sum(e["tokens"] for e in steps)
    src_tokens = sum(e["src_tokens"] for e in steps)
    seconds = sum(e["seconds"] for e in steps)
    tok_s = statistics.median(rates)
    if cfg["model"]["arch"] == "transformer":
        vocab = data_event["tgt_vocab"]
        model_flops_s = transformer_flops(cfg["model"], vocab, src_tokens / tokens * tok_s, tok_s)
    else:
        model_flops_s = 6 * model_event["parameters"] * tok_s
    peak = max(peak_by_source.values())
    return {
        "bench": "train",
        "config": name,
        "arch": cfg["model"]["arch"],
        "device": model_event["device"],
        "gpu": torch.cuda.get_device_name() if model_event["device"].startswith("cuda") else None,
        "torch": torch.__version__,
        "parameters": model_event["parameters"],
        "steps_measured": len(steps),
        "tokens_per_step": round(tokens / len(steps), 1),
        "tokens_per_s": round(tok_s, 1),
        "tokens_per_s_wall": round(tokens / seconds, 1),
        "src_tokens_per_s": round(src_tokens / seconds, 1),
        "seconds_per_step": round(seconds / len(steps), 4),
        "padding": round(statistics.mean(e["padding"] for e in steps), 4),
        "model_gflops": round(model_flops_s / 1e9, 1),
        "precision": precision,
        "matmul": model_event.get("matmul"),
        "peak_gflops": round(peak, 1),
        "peak_gflops_by_source": {k: round(v, 1) for k, v in peak_by_source.items()},
        "peak_share": round(model_flops_s / 1e9 / peak, 3),
        "max_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "dev_loss": round([e["dev_loss"] for e in events if e["event"] == "validation"][-1], 4),
        "dev_sentences": args.dev_sentences,
        "threads": args.threads,
        "procs": args.procs,
        "overrides": args.set,
    }


def add_train_args(t: argparse.ArgumentParser) -> None:
    """The options of `bench.py train`."""
    t.add_argument("--data", type=Path, default=Path("data/multi30k"), help="Multi30k folder")
    t.add_argument("--steps", type=int, default=200, help="training steps per config")
    t.add_argument("--warmup", type=int, default=50, help="steps left out of the figures")
    t.add_argument("--configs", type=lambda s: s.split(","), default=["T", "R"], help="T,R,base")
    t.add_argument("--device", default="cpu", help="cpu or cuda (train.device)")
    t.add_argument(
        "--threads", type=int, default=2,
        help="threads in all; 0: attnmt's choice (train.threads 0: the CPUs left free)",
    )  # fmt: skip
    t.add_argument(
        "--procs", type=int, default=1,
        help="data-parallel processes (torchrun, DDP), each with threads/procs threads",
    )  # fmt: skip
    t.add_argument("--dev-sentences", type=int, default=500, help="dev pairs for the dev loss")
    t.add_argument("--synthetic", type=int, default=0, help="N synthetic Tatoeba pairs instead")
    t.add_argument(
        "--tatoeba", type=Path, default=TATOEBA,
        help="English<TAB>French pairs for --synthetic",
    )  # fmt: skip
    t.add_argument("--vocab", type=int, default=8000, help="joint SentencePiece vocabulary")
    t.add_argument("--tokenizer", type=Path, help="an existing SentencePiece model")
    t.add_argument("--batch-tokens", type=int, help="base's target tokens a batch")
    t.add_argument(
        "--set", action="append", default=[], help="extra config override, e.g. train.compile=true"
    )
    t.add_argument("--keep", type=Path, help="copy each trained model directory to KEEP/CONFIG")
