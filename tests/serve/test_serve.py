"""The Python API and `attnmt serve`: the CLI's lines, over a real HTTP client on loopback."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from attnmt import Translator
from attnmt.errors import AttnmtError
from attnmt.serve.schema import Limits

from conftest import make_pairs
from helpers import cli_lines, free_port, start_server, wait_healthy

LINES = make_pairs(40, 7)[0]


def test_translator_gives_the_cli_lines(trained, run_cli):
    model, corpus = trained
    translator = Translator.load(model, device="cpu")
    for beam in (1, 3):
        assert translator.translate(LINES, beam=beam) == cli_lines(
            run_cli, model, LINES, "--beam", str(beam)
        )
    nbest = translator.hypotheses(LINES[:3], beam=3, n_best=2)
    assert [len(h) for h in nbest] == [2, 2, 2]
    assert [h[0].text for h in nbest] == translator.translate(LINES[:3], beam=3)
    refs = corpus["dev_tgt"].read_text().splitlines()
    scores = Translator.score(refs, refs)
    assert scores.bleu == pytest.approx(100.0) and scores.bleu_signature.startswith("nrefs:1")
    with pytest.raises(AttnmtError, match="2 hypotheses but 1 references"):
        Translator.score(["a", "b"], ["a"])


@pytest.mark.parametrize("copies", [1, 2])  # 2: an ensemble of the model with itself
def test_serve_answers_the_cli_lines_to_20_concurrent_clients(trained, run_cli, copies):
    model, _ = trained
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnmt", "serve", *["-m", str(model)] * copies, "--port",
         str(port), "--device", "cpu"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        expected = cli_lines(run_cli, model, LINES, "--beam", "2")

        def client(i: int) -> list[str]:
            mine = LINES[2 * i : 2 * i + 2]
            r = httpx.post(f"{url}/translate", json={"text": mine, "beam": 2}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["translations"]

        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(client, range(20)))
        assert [line for a in answers for line in a] == expected
        assert httpx.get(f"{url}/openapi.json").status_code == 200
        assert httpx.get(f"{url}/docs").status_code == 404  # Swagger UI loads a CDN: --docs
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["steps"] >= 1 and health["searching"] == 0
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    # The access log: a line per request (client, method, path, status, lines, ms).
    logged = [x for x in err.splitlines() if " POST /translate 200 2 lines " in x]
    assert len(logged) == 20 and logged[0].startswith("attnmt: 127.0.0.1 ")
    assert any(" GET /health 200 - lines " in x for x in err.splitlines())


def test_32_clients_with_mixed_options_get_the_batch_paths_lines(trained):
    """Each client's line joins the running search whenever it arrives; what it gets is what
    the batch path (translate, the Python API) gives it."""
    translator = Translator.load(trained[0], device="cpu")
    lines = LINES[:32]
    words = [line.split()[0] for line in lines]
    kinds = [  # (request fields, the Python API's arguments): 8 kinds, 4 clients each
        ({"beam": 1}, {"beam": 1}),
        ({"beam": 2}, {"beam": 2}),
        ({"beam": 3, "n_best": 2}, {"beam": 3, "n_best": 2}),
        ({"beam": 3, "length_penalty": 0.0}, {"beam": 3, "length_penalty": 0.0}),
        ({"beam": 1, "prefix": True}, {"beam": 1, "prefix": True}),
        ({"beam": 2, "prefix": True}, {"beam": 2, "prefix": True}),
        ({"beam": 2, "constraints": True}, {"beam": 2, "constraints": True}),
        ({"beam": 1, "attention": True}, {"beam": 1}),
    ]

    def per_line(fields: dict, i: int) -> dict:
        out = dict(fields)
        if out.pop("prefix", False):
            out["prefix"] = [words[i]]
        if out.pop("constraints", False):
            out["constraints"] = [[words[(i + 1) % 32]]]
        return out

    expected = []
    for i, line in enumerate(lines):
        args = per_line(kinds[i % 8][1], i)
        found = translator.hypotheses([line], **args)[0]
        expected.append([(h.text, h.score) for h in found])
    for url in start_server(translator, Limits(batch_wait_ms=0), access_log=False):

        def client(i: int, url: str = url) -> list[tuple[str, float | None]]:
            body = {"text": [lines[i]], **per_line(kinds[i % 8][0], i)}
            r = httpx.post(f"{url}/translate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answer = r.json()
            if answer.get("n_best"):
                return [(h["text"], h["score"]) for h in answer["n_best"][0]]
            return [(answer["translations"][0], None)]

        with ThreadPoolExecutor(32) as pool:
            got = list(pool.map(client, range(32)))
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert [t for t, _ in g] == [t for t, _ in e], (i, kinds[i % 8][0])
        if g[0][1] is not None:
            assert [x for _, x in g] == pytest.approx([x for _, x in e], abs=1e-4)


@pytest.fixture
def server(trained):
    """A server with small limits; yields the URL and the Translator (whose search a test may
    make block)."""
    translator = Translator.load(trained[0], device="cpu")
    for url in start_server(translator, Limits(max_lines=4, max_chars=50, max_queue=1)):
        yield url, translator


def test_limits_and_bad_requests_get_json_errors(server):
    url, _ = server
    post = lambda body, **kw: httpx.post(f"{url}/translate", timeout=30, **({"json": body} | kw))  # noqa: E731
    assert post({"text": ["w1"] * 5}).status_code == 413
    r = post({"text": ["w1 " * 20]})
    assert r.status_code == 413 and "at most 50" in r.json()["error"]
    assert post({"text": ["w1"], "beam": 0}).status_code == 422
    assert post({"text": "w1"}).status_code == 422
    assert (
        post(None, content=b"{not json", headers={"content-type": "application/json"}).status_code
        == 422
    )
    assert post({"text": []}).json() == {"translations": []}
    assert post({"text": ["w1 w2"]}).status_code == 200


def test_a_full_queue_is_503_and_the_server_keeps_serving(server, monkeypatch):
    url, translator = server
    release = threading.Event()
    real = translator.pool

    def slow(*args, **kw):  # a pool whose steps wait for the release
        pool = real(*args, **kw)
        step = pool.step
        pool.step = lambda: release.wait(30) and step()
        return pool

    monkeypatch.setattr(translator, "pool", slow)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(httpx.post, f"{url}/translate", json={"text": ["w1"]}, timeout=60)
        time.sleep(0.5)  # taken by the search thread, which now blocks
        second = pool.submit(
            httpx.post, f"{url}/translate", json={"text": ["w2"], "beam": 2}, timeout=60
        )
        time.sleep(0.5)  # waits in the queue (max_queue 1)
        third = httpx.post(f"{url}/translate", json={"text": ["w3"]}, timeout=60)
        assert third.status_code == 503 and "waiting" in third.json()["error"]
        release.set()
        assert first.result().status_code == 200 and second.result().status_code == 200


def test_the_api_is_closed_and_errors_have_one_shape(server):
    url, _ = server
    r = httpx.post(f"{url}/translate", json={"text": ["w1"], "beam_size": 5}, timeout=30)
    assert r.status_code == 422 and r.json() == {
        "error": "beam_size: Extra inputs are not permitted"
    }
    r = httpx.post(f"{url}/translate", json={"text": ["w1"], "sampling": {"seed": 1, "k": 2}})
    assert r.status_code == 422 and r.json()["error"].startswith("sampling.k: ")
    r = httpx.post(f"{url}/translate", json={"text": ["w1"], "beam": 2, "n_best": 3})
    assert r.status_code == 422 and "n_best 3 exceeds the beam size 2" in r.json()["error"]
    r = httpx.post(f"{url}/translate", json={"text": ["w1"], "beam": 2, "sampling": {}})
    assert r.status_code == 422 and "drop the beam" in r.json()["error"]
    for r, status in ((httpx.get(f"{url}/nowhere"), 404), (httpx.get(f"{url}/translate"), 405)):
        assert r.status_code == status and set(r.json()) == {"error"}, r.text
    schema = httpx.get(f"{url}/openapi.json").json()
    post = schema["paths"]["/translate"]["post"]
    fields = post["requestBody"]["content"]
    assert fields["application/json"]["schema"]["additionalProperties"] is False
    # The route is answered in front of FastAPI (serve/route.py); the document still has it.
    answer = post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert answer == "#/components/schemas/TranslateResponse"
    assert {"TranslateResponse", "ErrorResponse", "SamplingRequest", "Scored"} <= set(
        schema["components"]["schemas"]
    )
    assert r.headers["allow"] == "POST"  # GET /translate: 405


def test_n_best_length_penalty_and_sampling_over_http_equal_the_cli(server, trained, run_cli):
    url, _ = server
    model, _ = trained
    lines = LINES[:4]
    post = lambda body: httpx.post(f"{url}/translate", json={"text": lines} | body, timeout=60)  # noqa: E731
    r = post({"beam": 3, "n_best": 3, "length_penalty": 0.0})
    assert r.status_code == 200, r.text
    cli = cli_lines(run_cli, model, lines, "--beam", "3", "--n-best", "3", "--length-penalty", "0")
    got = [(i, h["text"], h["score"]) for i, n in enumerate(r.json()["n_best"]) for h in n]
    want = [(int(i), text, float(score)) for i, text, score in (x.split(" ||| ") for x in cli)]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    # The server encodes its lines packed, the CLI padded: attention's sums over padded keys
    # may round otherwise in the last bit, and a score printed to 4 decimals by 1e-4.
    assert [g[2] for g in got] == pytest.approx([w[2] for w in want], abs=2e-4)
    assert r.json()["translations"] == [n[0]["text"] for n in r.json()["n_best"]]
    r = post({"sampling": {"temperature": 1.5, "top_k": 5, "seed": 3}})
    cli = cli_lines(run_cli, model, lines, "--sampling", "--temperature", "1.5", "--top-k", "5",
                    "--seed", "3")  # fmt: skip
    assert r.status_code == 200 and r.json() == {"translations": cli}
