"""One model, several target languages: tags, per-direction validation, --target-lang."""

import json
import random
import threading
from pathlib import Path

import httpx
import pytest
import uvicorn

from attnmt import Translator
from attnmt.config import from_dict
from attnmt.data.store import open_store
from attnmt.errors import AttnmtError, ConfigError
from attnmt.models.directory import load_model_dir
from attnmt.serve.app import create_app
from attnmt.serve.schema import Limits
from attnmt.training.loop import train

from conftest import tiny_config, write_lines
from helpers import free_port, wait_healthy


def pairs(n: int, seed: int, lang: str) -> tuple[list[str], list[str]]:
    """Sentences of source words w0..w9 and their word-for-word 'translation' into `lang`."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = [rng.randrange(10) for _ in range(rng.randint(2, 6))]
        src.append(" ".join(f"w{i}" for i in words))
        tgt.append(" ".join(f"{lang}{i}" for i in words))
    return src, tgt


def split(base: Path, name: str, n: int, seed: int, lang: str) -> dict:
    src, tgt = pairs(n, seed, lang)
    return {
        "src": str(write_lines(base / f"{name}.src", src)),
        "tgt": str(write_lines(base / f"{name}.tgt", tgt)),
        "src_lang": "xx",
        "tgt_lang": lang,
    }


def multilingual_config(base: Path) -> dict:
    raw = tiny_config(
        {k: base / "unused" for k in ("train_src", "train_tgt", "dev_src", "dev_tgt")}
    )
    raw["data"]["train"] = [split(base, f"train-{lang}", 200, i, lang) for i, lang in
                            enumerate(("en", "fr"))]  # fmt: skip
    raw["data"]["dev"] = [split(base, f"dev-{lang}", 12, 10 + i, lang) for i, lang in
                          enumerate(("en", "fr"))]  # fmt: skip
    raw["data"]["test"] = [split(base, f"test-{lang}", 10, 20 + i, lang) for i, lang in
                           enumerate(("en", "fr"))]  # fmt: skip
    raw["tokenizer"]["vocab_size"] = 60
    raw["train"].update(max_steps=6, eval_every=3)
    return raw


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny multilingual model (xx -> en, xx -> fr), trained 6 steps."""
    base = tmp_path_factory.mktemp("multi")
    train(from_dict(multilingual_config(base)), base / "m", quiet=True)
    return base / "m"


def events(model: Path) -> list[dict]:
    return [json.loads(x) for x in (model / "train_log.jsonl").read_text().splitlines()]


def test_a_multilingual_run_tags_sources_and_scores_each_direction(multi: Path):
    meta = json.loads((multi / "attnmt.json").read_text())
    assert meta["multilingual"] and meta["directions"] == [["xx", "en"], ["xx", "fr"]]
    _, tokenizer, _ = load_model_dir(multi)
    tags = {lang: tokenizer.tag_id(lang) for lang in ("en", "fr")}
    assert None not in tags.values() and tokenizer.tag_id("de") is None
    store = open_store(multi)
    first = [int(store.src[i][0]) for i in range(len(store))]
    per_corpus = store.meta["corpus_pairs"]
    assert set(first[: per_corpus[0]]) == {tags["en"]} and set(first[per_corpus[0] :]) == {
        tags["fr"]
    }
    validation = [e for e in events(multi) if e["event"] == "validation"][-1]
    rows = validation["directions"]
    assert set(rows) == {"xx-en", "xx-fr"}
    assert validation["dev_bleu"] == pytest.approx(sum(r["dev_bleu"] for r in rows.values()) / 2)
    assert validation["dev_loss"] == pytest.approx(sum(r["dev_loss"] for r in rows.values()) / 2)
    tests = [e for e in events(multi) if e["event"] == "test"]
    assert [e["direction"] for e in tests] == ["xx-en", "xx-fr", "mean"]


def test_target_lang_is_needed_checked_and_shown_as_a_source_piece(multi: Path, run_cli, tmp_path):
    r = run_cli("translate", "-m", str(multi), stdin=b"w1 w2\n")
    assert r.code == 2 and "multilingual model: give --target-lang (en, fr" in r.stderr
    r = run_cli("translate", "-m", str(multi), "--target-lang", "de", stdin=b"w1 w2\n")
    assert r.code == 2 and "--target-lang 'de': this model translates into en, fr" in r.stderr
    maps = tmp_path / "maps"
    r = run_cli(
        "translate", "-m", str(multi), "--target-lang", "fr", "--attention", str(maps),
        stdin=b"w1 w2\n",
    )  # fmt: skip
    assert r.code == 0 and len(r.stdout.splitlines()) == 1, r.stderr
    assert json.loads((maps / "000000.json").read_text())["source_pieces"][0] == "<2fr>"
    translator = Translator.load(multi, device="cpu")
    assert translator.target_langs == ["en", "fr"]
    with pytest.raises(AttnmtError, match="give --target-lang"):
        translator.translate(["w1"])
    src = multi.parent / "test-en.src"
    e = run_cli("eval", "-m", str(multi), "--src", str(src), "--ref",
                str(multi.parent / "test-en.tgt"), "--target-lang", "en", "--json")  # fmt: skip
    test_en = next(x for x in events(multi) if x.get("direction") == "xx-en")
    assert e.code == 0 and json.loads(e.stdout)["chrf"] == test_en["chrf"], e.stderr


def test_the_server_takes_target_lang(multi: Path):
    translator = Translator.load(multi, device="cpu")
    config = uvicorn.Config(
        create_app(translator, Limits()), host="127.0.0.1", port=free_port(), log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    try:
        wait_healthy(url)
        post = lambda body: httpx.post(f"{url}/translate", json=body, timeout=60)  # noqa: E731
        ok = post({"text": ["w1 w2"], "target_lang": "en"})
        assert ok.json()["translations"] == translator.translate(["w1 w2"], target_lang="en")
        assert post({"text": ["w1 w2"]}).status_code == 422
        assert "translates into" in post({"text": ["w1"], "target_lang": "de"}).json()["error"]
        assert httpx.get(f"{url}/health").json()["target_langs"] == ["en", "fr"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_fine_tuning_keeps_the_tags_and_needs_them(multi: Path, trained, tmp_path: Path):
    raw = multilingual_config(tmp_path)
    raw["model"], raw["tokenizer"] = {}, {}
    raw["train"].update(max_steps=2, init_from=str(multi))
    train(from_dict(raw), tmp_path / "ft", quiet=True)
    assert Translator.load(tmp_path / "ft", device="cpu").translate(["w1"], target_lang="fr")
    raw["train"]["init_from"] = str(trained[0])  # a bilingual model: no tags
    with pytest.raises(ConfigError, match="no <2en>, <2fr> piece"):
        train(from_dict(raw), tmp_path / "ft2", quiet=True)


def test_the_ctranslate2_export_carries_the_tags_and_is_checked_per_direction(
    multi: Path, run_cli, tmp_path: Path
):
    pytest.importorskip("ctranslate2")
    check = write_lines(tmp_path / "check.txt", pairs(10, 40, "en")[0])
    r = run_cli("export", str(multi), str(tmp_path / "ct2"), "--check", str(check))
    assert r.code == 0, r.stderr
    assert "check.txt, into en): 10/10 identical" in r.stdout
    assert "check.txt, into fr): 10/10 identical" in r.stdout
    options = json.loads((tmp_path / "ct2" / "generation.json").read_text())
    assert options["source_prefix"] == {"en": "<2en>", "fr": "<2fr>"}
    r = run_cli("export", str(multi), str(tmp_path / "q"), "--check", str(check),
                "--quantization", "int8")  # fmt: skip
    assert r.code == 0 and "cost of int8 (greedy): chrF " in r.stdout
    assert "against the references" not in r.stdout  # --check FILE: no references
