"""Bad input on purpose (hypothesis): random configs and corpus files thrown at the CLI.

Every run either works or ends with one line on stderr and exit code 2: never a traceback,
never a misaligned pair, never a half-trained directory that translate takes for a model.
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnmt.data.text import read_parallel

from conftest import make_pairs, tiny_config, write_config

FUZZ = settings(
    max_examples=int(os.environ.get("ATTNMT_FUZZ_EXAMPLES", "12")),
    deadline=None,
    derandomize=os.environ.get("ATTNMT_FUZZ_EXAMPLES") is None,  # CI: the same examples every run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Line content that is legal inside one line: anything but '\n'.
TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(["a", "b", " ", "\t", "\x00", "\r", "\u2028", "\u2029", "\x0c", "é", "😀"]),
        st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)),
    ),
    max_size=12,
)


def check_outcome(result, out: Path, run_cli, where: str) -> None:
    assert result.code in (0, 2), (where, result)
    if result.code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("attnmt: error: "), (where, result.stderr)
        assert "Traceback" not in result.stderr
    if out.exists():
        # Whatever is on disk: translate either works on it or refuses it in one line.
        r = run_cli("translate", "--model", str(out), stdin=b"w1 w2\n\nw3\n")
        assert r.code in (0, 2), (where, r)
        if r.code == 0:
            assert r.stdout.count("\n") == 3
        else:
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@FUZZ
@given(
    pairs=st.lists(
        st.tuples(
            st.sampled_from(["text", "empty", "blank"]),
            TEXT,
            st.sampled_from(["text", "empty", "blank"]),
            TEXT,
        ),
        max_size=30,
    ),
    crlf=st.booleans(),
    gz=st.booleans(),
)
def test_pairs_never_shift(tmp_path_factory, pairs, crlf, gz):
    """Whatever the line contents, kept pairs are exactly the pairs with text on both sides."""
    d = tmp_path_factory.mktemp("align")

    def side(kind: str, text: str, i: int) -> str:
        return {"text": f"<{i}>{text}", "empty": "", "blank": " \t "}[kind]

    src = [side(ks, ts, i) for i, (ks, ts, _, _) in enumerate(pairs)]
    tgt = [side(kt, tt, i) for i, (_, _, kt, tt) in enumerate(pairs)]
    end = "\r\n" if crlf else "\n"
    paths = []
    for name, lines in (("s", src), ("t", tgt)):
        data = "".join(line + end for line in lines).encode("utf-8")
        path = d / (name + (".gz" if gz else ""))
        path.write_bytes(gzip.compress(data) if gz else data)
        paths.append(path)
    text = read_parallel(*paths)
    expected = [
        (s.strip(), t.strip()) for s, t in zip(src, tgt, strict=True) if s.strip() and t.strip()
    ]
    assert list(zip(text.src, text.tgt, strict=True)) == expected
    for s, t in zip(text.src, text.tgt, strict=True):
        assert s.split(">")[0] == t.split(">")[0]  # same line number on both sides


LINE_BYTES = st.one_of(
    st.sampled_from(
        [b"w1 w2", b"", b"   ", b"w3\r", b"w1\x00w2", b"\xff\xfe bad", b"w1\xe2\x80\xa8w2", b"\xc3"]
    ),
    st.just(b" ".join([b"w1"] * 10_000)),  # a 10,000-token line
    st.binary(max_size=8),
)


@FUZZ
@given(
    train_src=st.lists(LINE_BYTES, max_size=5),
    train_tgt=st.lists(LINE_BYTES, max_size=5),
    drop_dev_line=st.booleans(),
    empty_file=st.sampled_from([None, "train_src", "dev_tgt"]),
)
def test_random_corpus_files(
    tmp_path_factory, run_cli, train_src, train_tgt, drop_dev_line, empty_file
):
    d = tmp_path_factory.mktemp("corpus")
    src, tgt = make_pairs(40, 3)
    files = {}
    for name, lines in (("train_src", src), ("train_tgt", tgt)):
        extra = train_src if name == "train_src" else train_tgt
        files[name] = d / name
        files[name].write_bytes(b"".join(x.encode() + b"\n" for x in lines) + b"\n".join(extra))
    dev_src, dev_tgt = make_pairs(6, 4)
    if drop_dev_line:
        dev_tgt = dev_tgt[:-1]
    for name, lines in (("dev_src", dev_src), ("dev_tgt", dev_tgt)):
        files[name] = d / name
        files[name].write_text("".join(x + "\n" for x in lines))
    if empty_file:
        files[empty_file].write_bytes(b"")
    raw = tiny_config({k: v for k, v in files.items()})
    raw["train"].update(max_steps=2, eval_every=2)
    raw["decode"] = {"max_len_a": 0.0, "max_len_b": 4}
    cfg = write_config(d / "c.yaml", raw)
    out = d / "m"
    r = run_cli("train", "-c", str(cfg), "--out", str(out), "-q")
    check_outcome(r, out, run_cli, "train")
    # translate: random input bytes, including a 10,000-token line, on a trained model
    if r.code == 0:
        data = b"".join(line + b"\n" for line in train_src)
        r = run_cli("translate", "--model", str(out), stdin=data)
        check_outcome(r, d / "nothing", run_cli, "translate")
        if r.code == 0:
            assert r.stdout.count("\n") == data.count(b"\n")  # one line out per line in
    shutil.rmtree(d)


KEYS = [
    "data.max_len",
    "tokenizer.vocab_size",
    "tokenizer.joint",
    "tokenizer.model_type",
    "tokenizer.character_coverage",
    "model.arch",
    "model.emb_size",
    "model.hidden_size",
    "model.heads",
    "model.ff_size",
    "model.enc_layers",
    "model.dropout",
    "model.attention",
    "model.norm",
    "model.tie_embeddings",
    "train.batch_tokens",
    "train.lr",
    "train.lr_schedule",
    "train.warmup_steps",
    "train.label_smoothing",
    "train.clip_grad_norm",
    "train.seed",
    "train.device",
    "train.eval_every",
    "train.patience",
    "train.adam_betas",
    "train.teacher_forcing",
    "train.teacher_forcing.schedule",
    "train.teacher_forcing.start",
    "train.teacher_forcing.steps",
    "decode.beam",
    "decode.max_len_a",
    "decode.max_len_b",
    "data.train",
    "data",
    "bogus",
    "train.bogus",
    "model.arch.x",
]
VALUES = st.one_of(
    st.sampled_from(
        [0, 1, 2, 3, 8, -1, 10**6, 10**12, 2**63, 0.5, -0.5, 1e308, float("nan"), float("inf")]
    ),
    st.sampled_from(["", "rnn", "transformer", "dot", "post", "linear", "cpu", "cuda", "x" * 50]),
    st.sampled_from([None, True, False, [], [0.9], [0.9, 0.98, 0.1], {}, {"schedule": "linear"}]),
)


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3))
def test_random_configs(tmp_path_factory, run_cli, changes):
    d = tmp_path_factory.mktemp("cfg")
    files = {}
    for split, n, seed in (("train", 60, 1), ("dev", 6, 2)):
        src, tgt = make_pairs(n, seed)
        for side, lines in (("src", src), ("tgt", tgt)):
            files[f"{split}_{side}"] = d / f"{split}.{side}"
            files[f"{split}_{side}"].write_text("".join(x + "\n" for x in lines))
    raw = tiny_config(files)
    raw["decode"] = {"max_len_a": 1.0, "max_len_b": 4}
    cfg = write_config(d / "c.yaml", raw)
    args = ["train", "-c", str(cfg), "--out", str(d / "m"), "-q"]
    for key, value in changes:
        args += ["--set", f"{key}={_yaml(value)}"]
    # Keep every run short, whatever else the fuzzer chose.
    args += ["--set", "train.max_steps=2", "--set", "train.max_epochs=1"]
    r = run_cli(*args)
    check_outcome(r, d / "m", run_cli, f"train {changes}")
    shutil.rmtree(d)


def _yaml(value) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
