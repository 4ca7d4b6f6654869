"""attnmt serve's translation page in a real headless Chromium (selenium and chromedriver, from
Debian's chromium and chromium-driver packages, which .ci/run installs), and the attention the
JSON API returns for it."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from attnmt import Translator
from attnmt.serve.schema import Limits

from helpers import cli_lines, start_server

SENTENCE = "w1 w2 w3 w4"


@pytest.fixture(scope="module")
def server(trained) -> Iterator[str]:
    translator = Translator.load(trained[0], device="cpu")
    yield from start_server(translator, Limits(max_chars=60), "tiny")


def test_the_api_returns_each_layer_and_heads_attention(server, trained, tmp_path, run_cli):
    model, _ = trained
    r = httpx.post(f"{server}/translate", json={"text": [SENTENCE], "attention": True}, timeout=60)
    assert r.status_code == 200, r.text
    found = r.json()["attention"][0][0]
    weights = torch.tensor(found["weights"])  # (layers, heads, T, S)
    assert weights.shape == (1, 2, len(found["tgt_pieces"]), len(found["src_pieces"]))
    assert found["src_pieces"][-1] == "</s>"
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-3, rtol=0)
    # The mean of the top layer's heads is what translate --attention writes for the line.
    assert run_cli("translate", "-m", str(model), "--attention", str(tmp_path / "maps"),
                   stdin=f"{SENTENCE}\n".encode()).code == 0  # fmt: skip
    written = json.loads((tmp_path / "maps" / "000000.json").read_text())
    assert written["target_pieces"] == found["tgt_pieces"]
    torch.testing.assert_close(weights[-1].mean(0), torch.tensor(written["weights"]), atol=1e-3,
                               rtol=0)  # fmt: skip
    plain = httpx.post(f"{server}/translate", json={"text": [SENTENCE]}, timeout=60).json()
    assert "attention" not in plain


def open_page(browser, url: str):
    """Open the page and wait for /health's answer; returns the wait."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{url}/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "body[data-ready]"))
    return wait


def translate_on_the_page(browser, url: str, sentence: str, details: bool = True) -> None:
    """Open the page, (with `details`: ask, under More options, for the other translations
    and the attention), type the text, press Ctrl+Enter, wait for the answer."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    wait = open_page(browser, url)
    if details:
        browser.find_element(By.CSS_SELECTOR, "#more summary").click()
        browser.find_element(By.ID, "details").click()
    box = browser.find_element(By.ID, "source")
    box.clear()
    box.send_keys(sentence, Keys.CONTROL, Keys.ENTER)
    if details:
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#heatmap tbody td"))
    else:
        wait.until(lambda d: d.find_element(By.ID, "results").is_displayed())


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_the_page_in_a_browser(server, trained, browser, run_cli, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    model, _ = trained
    translate_on_the_page(browser, server, SENTENCE)
    text = browser.find_element(By.ID, "translation").text
    assert text == cli_lines(run_cli, model, [SENTENCE], "--beam", "5")[0]
    assert not browser.find_element(By.ID, "lang").is_displayed()  # a bilingual model
    hyps = browser.find_elements(By.CSS_SELECTOR, "#hypotheses li")
    assert len(hyps) == 3 and hyps[0].find_element(By.TAG_NAME, "button").text == text

    def cells() -> list[str]:
        rows = browser.find_elements(By.CSS_SELECTOR, "#heatmap tbody tr")
        cols = browser.find_elements(By.CSS_SELECTOR, "#heatmap thead th")
        found = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "#heatmap tbody td")]
        assert len(found) == len(rows) * len(cols) > 0  # one cell per (target, source) piece
        return found

    mean = cells()
    Select(browser.find_element(By.ID, "head")).select_by_value("1")
    assert cells() != mean  # head 2 alone, not the mean of both
    # Focusing an output piece (keyboard or mouse) marks the source pieces it looks at most.
    browser.find_element(By.CSS_SELECTOR, "#heatmap tbody th button").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#heatmap thead th.hl")

    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot))
    width, height = browser.execute_script(
        "return [window.innerWidth * devicePixelRatio, window.innerHeight * devicePixelRatio]"
    )
    assert png_size(shot) == (int(width), int(height))

    # 400 % zoom of a 1,280-pixel screen is 320 CSS pixels: the page reflows, only the heatmap
    # scrolls (inside its own box).
    browser.set_window_size(320, 900)
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth"
    ), "the page scrolls sideways at 320 CSS pixels"
    box = browser.find_element(By.ID, "source")
    box.clear()
    box.send_keys("w1 " * 30, Keys.CONTROL, Keys.ENTER)  # 90 characters: over 60 a line
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "error").text)
    error = browser.find_element(By.ID, "error").text
    assert error == "Error 413: text[0]: 90 characters; at most 60", error


def test_the_page_shows_the_terms_applied(trained, browser):
    from selenium.webdriver.common.by import By

    from attnmt.decoding.terminology import Term, Terminology

    translator = Translator.load(trained[0], device="cpu")
    translator.terminology = Terminology([Term("w2", "t9 t9"), Term("w7", "t1")])
    for url in start_server(translator, Limits(), "terms"):
        translate_on_the_page(browser, url, SENTENCE)
        assert browser.find_element(By.ID, "terms").text == "Terms applied: w2 → t9 t9"
        assert " t9 t9 " in f" {browser.find_element(By.ID, 'translation').text} "
        translate_on_the_page(browser, url, "w3 w4", details=False)
        assert not browser.find_element(By.ID, "terms").is_displayed()
        assert not browser.find_element(By.ID, "heatmap").is_displayed()  # not asked for


def test_the_page_of_a_multilingual_model_asks_for_the_language(
    browser, tmp_path_factory: pytest.TempPathFactory
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    from attnmt.config import from_dict
    from attnmt.training.loop import train

    from conftest import make_pairs, tiny_config, write_lines

    base = tmp_path_factory.mktemp("multi-page")
    src, tgt = make_pairs(200, 1)
    files = {"src": str(write_lines(base / "s", src)), "tgt": str(write_lines(base / "t", tgt))}
    raw = tiny_config({k: base / k for k in ("train_src", "train_tgt", "dev_src", "dev_tgt")})
    raw["data"]["train"] = [{**files, "src_lang": "fr", "tgt_lang": lang} for lang in ("de", "en")]
    raw["data"]["dev"] = [{**files, "tgt_lang": lang} for lang in ("de", "en")]
    raw["train"].update(max_steps=2, eval_every=2)
    train(from_dict(raw), base / "m", quiet=True)
    translator = Translator.load(base / "m", device="cpu")
    for url in start_server(translator, Limits(), "multi"):
        wait = open_page(browser, url)
        assert not browser.find_element(By.ID, "results").is_displayed()  # nothing yet
        assert browser.find_element(By.ID, "direction").text == "French → German, English"
        names = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#lang option")]
        assert names == ["choose…", "German", "English"]
        assert Select(browser.find_element(By.ID, "lang")).first_selected_option.text == "choose…"
        browser.find_element(By.ID, "source").send_keys("w1 w2", Keys.CONTROL, Keys.ENTER)
        assert browser.find_element(By.ID, "translation").text == ""  # no default language
        Select(browser.find_element(By.ID, "lang")).select_by_value("en")
        browser.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "results").is_displayed())


def test_the_page_translates_lines_with_markup_and_a_glossary_and_copies(
    server, trained, browser, run_cli
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    model, _ = trained
    wait = open_page(browser, server)
    assert not browser.find_element(By.ID, "direction").is_displayed()  # languages unnamed
    assert not browser.find_element(By.ID, "beam").is_displayed()  # under More options
    lines = ["w1 w2", "w3", "w4 w5 w6"]
    box = browser.find_element(By.ID, "source")
    box.send_keys(lines[0], Keys.ENTER, lines[1], Keys.ENTER, lines[2], Keys.CONTROL, Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "results").is_displayed())
    shown = browser.find_element(By.ID, "translation").text.split("\n")
    assert shown == cli_lines(run_cli, model, lines, "--beam", "5")  # each line, in order
    assert not browser.find_element(By.ID, "heatmap").is_displayed()  # maps: one line only
    browser.find_element(By.ID, "copy").click()
    wait.until(lambda d: d.find_element(By.ID, "copied").text == "Copied.")

    box.clear()
    browser.find_element(By.CSS_SELECTOR, "#more summary").click()
    browser.find_element(By.ID, "markup").click()
    browser.find_element(By.ID, "glossary").send_keys("w2 = t9")
    box.send_keys("<b>w1</b> w2", Keys.CONTROL, Keys.ENTER)
    wait.until(lambda d: "<b>" in d.find_element(By.ID, "translation").text)
    text = browser.find_element(By.ID, "translation").text
    assert text.count("<b>") == 1 and text.count("</b>") == 1 and "t9" in text.split(), text
    assert browser.find_element(By.ID, "terms").text == "Terms applied: w2 → t9"
    # A terminology file's line (source TAB target), as translate --terminology reads it.
    gloss = browser.find_element(By.ID, "glossary")
    gloss.clear()
    browser.execute_script("arguments[0].value = 'w1\\tt8'", gloss)
    box.clear()
    box.send_keys("w1 w2", Keys.CONTROL, Keys.ENTER)
    wait.until(lambda d: d.find_element(By.ID, "terms").text == "Terms applied: w1 → t8")
