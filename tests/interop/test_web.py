"""attnmt export --format web: the page translates in headless Chromium as attnmt does
(greedy and beam, ?q= on load, Ctrl+Enter), its SentencePiece in JavaScript segments as
SentencePiece does (unigram and BPE, in Node), and a missing runtime is one clear line."""

from __future__ import annotations

import contextlib
import functools
import gzip
import http.server
import json
import shutil
import subprocess
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import sentencepiece as spm

from attnmt import Translator
from attnmt.config import from_dict
from attnmt.data.tokenizer import SubwordVocab
from attnmt.decoding.options import not_exported
from attnmt.interop.onnx import MANIFEST
from attnmt.interop.tokenizer_json import tokenizer_json
from attnmt.interop.web import PAGE, RUNTIME, RUNTIME_FILES
from attnmt.training.loop import train

from conftest import tiny_config

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

NODE = shutil.which("node")
HAS_RUNTIME = all((RUNTIME / name).is_file() for name in RUNTIME_FILES)
NO_RUNTIME = "onnxruntime-web is not installed: python scripts/get_web_runtime.py (as .ci/run does)"


@pytest.mark.skipif(NODE is None, reason="no Node.js here (the tokenizer's test runs it)")
@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_the_javascript_tokenizer_segments_as_sentencepiece(tmp_path: Path, corpus, model_type):
    model = tmp_path / "m"
    spm.SentencePieceTrainer.train(
        input=str(corpus["train_src"]), model_prefix=str(model), vocab_size=40,
        hard_vocab_limit=False, model_type=model_type, character_coverage=0.98,
        user_defined_symbols=["<2en>"],
    )  # fmt: skip
    vocab = SubwordVocab((tmp_path / "m.model").read_bytes())
    lines = corpus["dev_src"].read_text().splitlines()
    lines += ["  zwei   Hunde! ", "Ünïcödé ½ ﬁ", "日本語 😀 qx", "", "x <2en> y", "😀 am Anfang"]
    spec = tmp_path / "tokenizer.json"
    spec.write_text(json.dumps(tokenizer_json(vocab.proto, vocab.reserved), ensure_ascii=False))
    script = (
        f"const {{ Tokenizer }} = require({json.dumps(str(PAGE / 'tokenizer.js'))});"
        "const fs = require('fs');"
        f"const t = new Tokenizer(JSON.parse(fs.readFileSync({json.dumps(str(spec))})));"
        "const lines = JSON.parse(fs.readFileSync(0));"
        "const found = lines.map((l) => { const ids = t.encode(l); return [ids, t.decode(ids)]; });"
        "console.log(JSON.stringify(found));"
    )  # fmt: skip
    done = subprocess.run(
        [NODE, "-e", script], input=json.dumps(lines), capture_output=True, text=True, check=True
    )
    got = json.loads(done.stdout)
    want = vocab.encode(lines)
    assert [ids for ids, _ in got] == want
    assert [text for _, text in got] == [vocab.decode(ids) for ids in want]


@contextlib.contextmanager
def static_server(folder: Path) -> Iterator[str]:
    """`folder` served on a loopback port, as python -m http.server serves it."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def page_output(browser, url: str) -> str:
    """Open url and wait for the page to finish (#output filled or #error set)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    WebDriverWait(browser, 120).until(
        lambda d: (
            d.execute_script("return document.body.dataset.ready")
            or d.find_element(By.ID, "error").text
        )
    )
    assert browser.find_element(By.ID, "error").text == ""
    # The text as it is (the driver's .text trims spaces at the ends of lines).
    return browser.execute_script("return document.getElementById('output').textContent")


@pytest.mark.skipif(not HAS_RUNTIME, reason=NO_RUNTIME)
def test_the_page_translates_in_the_browser_as_attnmt(tmp_path: Path, trained, browser, run_cli):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    model, corpus = trained
    out = tmp_path / "web"
    result = run_cli("export", str(model), str(out), "--format", "web")
    assert result.code == 0, result.stderr
    assert "20/20 identical" in result.stdout
    assert {"index.html", "runtime", "model"} <= {p.name for p in out.iterdir()}
    assert sorted(p.name for p in (out / "runtime").iterdir()) == sorted(
        [*RUNTIME_FILES, "LICENSE"]
    )
    lines = corpus["dev_src"].read_text().splitlines()
    ours = Translator.load(model)
    q = urllib.parse.quote("\n".join(lines))
    with static_server(out) as base:
        greedy = page_output(browser, f"{base}/index.html?q={q}")
        assert greedy.split("\n") == ours.translate(lines, beam=1)
        beam = page_output(browser, f"{base}/index.html?q={q}&beam=3")
        assert beam.split("\n") == ours.translate(lines, beam=3)
        assert not browser.find_element(By.ID, "direction").is_displayed()  # languages unnamed
        assert not browser.find_element(By.ID, "beam").is_displayed()  # under More options
        # A glossary, in the terminology file's form: its terms, as translate --terminology.
        (tmp_path / "terms.tsv").write_text("w2\tt9 t9\n")
        termed = Translator.load(model, terminology=tmp_path / "terms.tsv")
        glossary = urllib.parse.quote("w2\tt9 t9")
        got = page_output(browser, f"{base}/index.html?q={q}&glossary={glossary}").split("\n")
        held = [i for i, line in enumerate(lines) if "w2" in line.split()]
        width = max(2, termed.cfg.decode.beam)  # the page's beam is 1: the model's, for them
        want = termed.translate([lines[i] for i in held], beam=width)
        assert held and [got[i] for i in held] == want
        assert all("t9 t9" in got[i] for i in held)
        others = [i for i in range(len(lines)) if i not in held]
        assert [got[i] for i in others] == ours.translate([lines[i] for i in others], beam=1)
        assert browser.find_element(By.ID, "terms").text == "Glossary terms used: w2 → t9 t9"
        # By keyboard: the text, then Ctrl+Enter.
        page_output(browser, f"{base}/index.html")
        source = browser.find_element(By.ID, "source")
        source.send_keys(lines[0])
        source.send_keys(Keys.CONTROL, Keys.ENTER)
        want = ours.translate(lines[:1], beam=1)[0]
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "output").text == want)
        # 400 % zoom of a 1,280-pixel screen is 320 CSS pixels: the page reflows.
        browser.set_window_size(320, 900)
        assert browser.execute_script(
            "return document.documentElement.scrollWidth <= window.innerWidth"
        )
        browser.set_window_size(1000, 900)
        requests = browser.execute_script(
            "return performance.getEntriesByType('resource').map((e) => e.name)"
        )
        assert requests and all(r.startswith(base) for r in requests)  # nothing from elsewhere
    # Opened as a file (a folder received by mail): the page says to serve it, and is ready.
    browser.get((out / "index.html").as_uri())
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.CSS_SELECTOR, "body[data-ready]"))
    error = browser.find_element(By.ID, "error").text
    assert "opened as a file" in error and "python -m http.server" in error


def test_a_missing_runtime_is_one_line(tmp_path: Path, trained, run_cli):
    model, _ = trained
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli(
        "export", str(model), str(tmp_path / "web"), "--format", "web", "--runtime", str(empty)
    )
    assert result.code == 2
    assert "onnxruntime-web is missing" in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "web").exists()


@pytest.mark.skipif(not HAS_RUNTIME, reason=NO_RUNTIME)
def test_without_a_copy_the_first_export_fetches_the_runtime_once(
    tmp_path: Path, trained, run_cli, monkeypatch
):
    """The npm registry stood in for by a .tgz of the package's dist/ files."""
    import tarfile

    from attnmt.interop import web, web_runtime

    package = tmp_path / "onnxruntime-web.tgz"
    with tarfile.open(package, "w:gz") as tgz:
        for name in RUNTIME_FILES:
            data = (RUNTIME / name).read_bytes()
            if name.endswith(".gz"):
                name, data = name.removesuffix(".gz"), gzip.decompress(data)
            (tmp_path / name).write_bytes(data)
            tgz.add(tmp_path / name, f"package/dist/{name}")
    packs: list[Path] = []
    monkeypatch.setattr(web_runtime, "npm_pack", lambda tmp: packs.append(tmp) or package)
    monkeypatch.setattr(web, "RUNTIME", tmp_path / "no-copy")
    monkeypatch.setenv("ATTNMT_CACHE", str(tmp_path / "cache"))
    model, _ = trained
    first = run_cli("export", str(model), str(tmp_path / "a"), "--format", "web")
    assert first.code == 0, first.stderr
    assert first.stderr.count("fetching it from the npm registry (once)") == 1
    fetched = tmp_path / "cache" / "web-runtime" / web_runtime.VERSION
    assert sorted(p.name for p in (tmp_path / "a" / "runtime").iterdir()) == sorted(
        [*RUNTIME_FILES, "LICENSE"]
    )
    assert (fetched / "LICENSE").is_file()
    second = run_cli("export", str(model), str(tmp_path / "b"), "--format", "web")
    assert second.code == 0 and "fetching" not in second.stderr and len(packs) == 1

    def unreachable(tmp: Path) -> Path:
        raise web_runtime.FetchError("npm pack failed: ENOTFOUND registry.npmjs.org")

    monkeypatch.setattr(web_runtime, "npm_pack", unreachable)
    monkeypatch.setenv("ATTNMT_CACHE", str(tmp_path / "empty-cache"))
    failed = run_cli("export", str(model), str(tmp_path / "c"), "--format", "web")
    assert failed.code == 2 and "could not be fetched (npm pack failed" in failed.stderr
    assert failed.stderr.strip().splitlines()[-1].startswith("attnmt: error: onnxruntime-web")
    assert not (tmp_path / "c").exists()


@pytest.mark.skipif(not HAS_RUNTIME, reason=NO_RUNTIME)
def test_a_multilingual_page_translates_into_the_chosen_language(tmp_path: Path, browser, run_cli):
    from selenium.webdriver.common.by import By

    from attnmt.config import from_dict
    from attnmt.training.loop import train

    from conftest import make_pairs, tiny_config, write_lines

    src, tgt = make_pairs(200, 1)
    files = {
        "src": str(write_lines(tmp_path / "s", src)),
        "tgt": str(write_lines(tmp_path / "t", tgt)),
    }
    raw = tiny_config({k: tmp_path / k for k in ("train_src", "train_tgt", "dev_src", "dev_tgt")})
    raw["data"]["train"] = [{**files, "src_lang": "fr", "tgt_lang": lang} for lang in ("de", "en")]
    raw["data"]["dev"] = [{**files, "tgt_lang": lang} for lang in ("de", "en")]
    raw["train"].update(max_steps=2, eval_every=2)
    train(from_dict(raw), tmp_path / "m", quiet=True)
    # onnxruntime-web's own dist/ files (the module not compressed) as --runtime: the page
    # gets the module gzipped, as from attnmt's copy.
    dist = tmp_path / "dist"
    dist.mkdir()
    for name in RUNTIME_FILES:
        data = (RUNTIME / name).read_bytes()
        if name.endswith(".gz"):
            name, data = name.removesuffix(".gz"), gzip.decompress(data)
        (dist / name).write_bytes(data)
    result = run_cli(
        "export",
        str(tmp_path / "m"),
        str(tmp_path / "web"),
        "--format",
        "web",
        "--runtime",
        str(dist),
    )
    assert result.code == 0, result.stderr
    module = tmp_path / "web" / "runtime" / "ort-wasm-simd-threaded.wasm.gz"
    assert (
        gzip.decompress(module.read_bytes()) == (dist / "ort-wasm-simd-threaded.wasm").read_bytes()
    )
    assert "into de" in result.stdout and "into en" in result.stdout
    ours = Translator.load(tmp_path / "m")
    lines = src[:5]
    q = urllib.parse.quote("\n".join(lines))
    with static_server(tmp_path / "web") as base:
        for lang in ("de", "en"):
            got = page_output(browser, f"{base}/index.html?q={q}&lang={lang}")
            assert got.split("\n") == ours.translate(lines, beam=1, target_lang=lang)
            assert browser.find_element(By.ID, "lang").get_attribute("value") == lang
        # The direction in plain words, the languages by name.
        assert browser.find_element(By.ID, "direction").text == "French → German, English"
        names = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#lang option")]
        assert names == ["German", "English"]


@pytest.mark.skipif(not HAS_RUNTIME, reason=NO_RUNTIME)
def test_a_student_with_a_shortlist_translates_over_it(tmp_path: Path, trained, browser, run_cli):
    model, corpus = trained
    student = tmp_path / "student"
    shutil.copytree(model, student)
    assert run_cli("shortlist", "-m", str(student), "--k", "2", "--frequent", "1").code == 0
    result = run_cli("export", str(student), str(tmp_path / "web"), "--format", "web")
    assert result.code == 0, result.stderr
    assert "20/20 identical" in result.stdout  # onnxruntime over the shortlist, as attnmt's
    info = json.loads((tmp_path / "web" / "model" / "attnmt-onnx.json").read_text())
    assert info["shortlist"]["k"] == 2 and "rows" in info["decoder"]["inputs"]
    ours = Translator.load(student, shortlist=True)
    plain = Translator.load(student, shortlist=False)
    lines = corpus["dev_src"].read_text().splitlines()[:6]
    differs = 0
    with static_server(tmp_path / "web") as base:
        for line in lines:  # a shortlist is a batch's: a line at a time on both sides
            q = urllib.parse.quote(line)
            assert (
                page_output(browser, f"{base}/index.html?q={q}")
                == ours.translate([line], beam=1)[0]
            )
            beam = page_output(browser, f"{base}/index.html?q={q}&beam=3")
            assert beam == ours.translate([line], beam=3)[0]
            differs += beam != plain.translate([line], beam=3)[0]
    assert differs  # the shortlist changed some output: it was applied


@pytest.mark.skipif(not HAS_RUNTIME, reason=NO_RUNTIME)
def test_7_the_page_searches_with_the_models_length_norm(tmp_path: Path, corpus, browser, run_cli):
    """Issue 77, item 7: the page's beam search hard-coded the GNMT length penalty; for a
    `decode.length_norm: length` model 5 of 50 beam-5 lines differed from attnmt's."""
    raw = tiny_config(corpus)
    raw["train"].update(max_steps=40, eval_every=40)
    raw["decode"] = {"length_norm": "length", "length_penalty": 1.0}
    train(from_dict(raw), tmp_path / "m", quiet=True)
    out = tmp_path / "web"
    assert run_cli("export", str(tmp_path / "m"), str(out), "--format", "web").code == 0
    assert json.loads((out / "model" / MANIFEST).read_text())["length_norm"] == "length"
    lines = corpus["dev_src"].read_text().splitlines()
    ours = Translator.load(tmp_path / "m")
    want = ours.translate(lines, beam=5)
    gnmt = [r[0].text for r in ours.search(lines, ours.options(beam=5, length_norm="gnmt"))]
    assert want != gnmt, "the two forms agree on every line here: the test could not fail"
    with static_server(out) as base:
        q = urllib.parse.quote("\n".join(lines))
        assert page_output(browser, f"{base}/index.html?q={q}&beam=5").split("\n") == want
        # Issue 78: the manifest's options are taken from the URL by name; the page lists
        # what it cannot do (n_best, sampling), as the export said.
        url = f"{base}/index.html?q={q}&beam=5&length_norm=gnmt"
        assert page_output(browser, url).split("\n") == gnmt
        from selenium.webdriver.common.by import By

        assert not browser.find_element(By.ID, "limits").is_displayed()  # under More options
        browser.find_element(By.CSS_SELECTOR, "#more summary").click()
        limits = browser.find_element(By.ID, "limits").text
        assert all(name in limits for name in not_exported())
