"""`scripts/bench.py onnx`: a model's ONNX export run by onnxruntime (Python) and its web
export's page in headless Chromium (onnxruntime-web, WebAssembly), beside attnmt's own greedy
decoding of the same model, fp32 and int8, on Multi30k test_2016_flickr.

Each row: sentences/s and output words/s (the median of --runs after one warm-up; model
loading excluded, tokenizing included), BLEU and chrF with sacreBLEU's signature. attnmt and
onnxruntime decode in batches of 16 sentences of similar length, as the page does; the page
is timed by itself (window.attnmtTiming, from the click to the last line). The page's thread
rows are served cross-origin isolated (COOP/COEP headers), which onnxruntime-web's threads
need; the others are served as `python -m http.server` serves them.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import shutil
import statistics
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import torch

from attnmt.data.text import read_lines
from attnmt.data.tokenizer import EOS_ID
from attnmt.decoding.scores import score
from attnmt.decoding.translator import Translator
from attnmt.interop.onnx_run import OnnxModel
from attnmt.interop.web import export_web

BATCH = 16  # the page's greedy batch (interop/web/search.js)
BATCH_TOKENS = 16 * 20  # attnmt's batches by tokens: about 16 of Multi30k's sentences


def bench_onnx(args: argparse.Namespace) -> None:
    src = read_lines(args.data / "test_2016_flickr.de.gz")[: args.sentences]
    ref = read_lines(args.data / "test_2016_flickr.en.gz")[: args.sentences]
    torch.set_num_threads(args.threads)
    for precision in args.precision:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "web"
            export_web(args.model, folder, quantization="int8" if precision == "int8" else None)
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            model_size = sum(p.stat().st_size for p in (folder / "model").glob("*.onnx"))
            common = {
                "model": str(args.model), "precision": precision,
                "folder_mb": round(size / 1e6, 1), "onnx_mb": round(model_size / 1e6, 1),
            }  # fmt: skip
            ours = Translator.load(args.model, "cpu", "best", precision, workers=1)
            theirs = OnnxModel(folder / "model", threads=args.threads)
            runs = {
                "attnmt": functools.partial(attnmt_greedy, ours, src),
                "onnxruntime": functools.partial(onnx_greedy, theirs, ours, src),
            }
            for runtime, run in runs.items():
                report(runtime, timed(run, args.runs), ref, common, args.threads)
            for threads in args.page_threads if args.browser else []:
                found = page_runs(folder, src, threads, args.runs)
                report("onnxruntime-web", found, ref, common, threads)


def timed(run: Callable[[], list[str]], runs: int) -> tuple[list[float], list[str]]:
    run()
    times, hyps = [], []
    for _ in range(runs):
        start = time.perf_counter()
        hyps = run()
        times.append(time.perf_counter() - start)
    return times, hyps


def attnmt_greedy(ours: Translator, lines: list[str]) -> list[str]:
    """attnmt's greedy search in batches of BATCH similar-length sentences, as the page's."""
    return ours.translate(lines, beam=1, batch_tokens=BATCH_TOKENS)


def onnx_greedy(model: OnnxModel, ours: Translator, lines: list[str]) -> list[str]:
    """The page's order: sentences sorted by length, in batches of BATCH."""
    tok = ours.tokenizer
    src = [[*ids, EOS_ID] for ids in tok.src.encode(lines)]
    order = sorted(range(len(src)), key=lambda i: len(src[i]))
    out = [""] * len(src)
    for at in range(0, len(order), BATCH):
        part = order[at : at + BATCH]
        for i, ids in zip(part, model.greedy([src[i] for i in part]), strict=True):
            out[i] = tok.tgt.decode(ids)
    return out


def report(
    runtime: str, found: tuple[list[float], list[str]], ref: list[str], common: dict, threads: int
) -> None:
    times, hyps = found
    seconds = statistics.median(times)
    words = sum(len(h.split()) for h in hyps)
    s = score(hyps, ref)
    row = {
        "bench": "onnx", "runtime": runtime, "threads": threads, **common,
        "sentences": len(hyps), "runs": len(times), "seconds_all": [round(x, 3) for x in times],
        "sentences_per_s": round(len(hyps) / seconds, 1), "words_per_s": round(words / seconds, 1),
        "bleu": round(s.bleu, 2), "chrf": round(s.chrf, 2), "bleu_signature": s.bleu_signature,
    }  # fmt: skip
    print(json.dumps(row), flush=True)


class _Handler(http.server.SimpleHTTPRequestHandler):
    isolated = False

    def end_headers(self) -> None:
        if self.isolated:  # what onnxruntime-web's threads (SharedArrayBuffer) need
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()

    def log_message(self, *args: object) -> None:
        pass


def page_runs(
    folder: Path, src: list[str], threads: int, runs: int
) -> tuple[list[float], list[str]]:
    """The page's own timing of translating src, a warm-up then `runs` loads."""
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    handler = type("H", (_Handler,), {"isolated": threads > 1})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(folder))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(
        options=options, service=webdriver.ChromeService(shutil.which("chromedriver"))
    )
    base = f"http://127.0.0.1:{server.server_address[1]}/index.html"
    text = urllib.parse.quote("\n".join(src))  # in the fragment: a server takes 64 kB URLs
    times, hyps = [], []
    try:
        for i in range(runs + 1):
            driver.get(f"{base}?run={i}#threads={threads}&q={text}")  # a new page each run
            WebDriverWait(driver, 1800).until(
                lambda d: (
                    d.execute_script("return document.body.dataset.ready")
                    or d.find_element(By.ID, "error").text
                )
            )
            error = driver.find_element(By.ID, "error").text
            if error:
                raise RuntimeError(f"the page: {error}")
            if i:
                times.append(driver.execute_script("return window.attnmtTiming.seconds"))
                hyps = driver.find_element(By.ID, "output").text.split("\n")
    finally:
        driver.quit()
        server.shutdown()
    return times, hyps
