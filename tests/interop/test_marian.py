"""attnmt import --format marian: native Marian models (model.npz, decoder.yml, vocabularies).

Without Marian: random model.npz files are imported and their logits compared with a small
reference written here from Marian's transformer (queries from the pre-norm input, keys and
values as Marian's scorer computes them, its sinusoid table, zero start embedding). With the
pymarian wheel (../shared/peers' marian venv, or PYMARIAN_PYTHON naming a Python that has it): a
tiny model trained by Marian itself, scored by `marian score` and by attnmt, to 1e-4."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
import yaml

from attnmt import Translator
from attnmt.errors import CheckpointError
from attnmt.interop.marian import native_files, read_vocab

from conftest import make_pairs, write_lines
from helpers import assert_user_error

D, H, FF, V_EXTRA = 16, 2, 32, 0
PYMARIAN = os.environ.get("PYMARIAN_PYTHON", "/tmp/peers-run/venvs/marian/bin/python")


def spm_and_vocab(tmp: Path) -> tuple[Path, Path, list[str]]:
    """A SentencePiece model of the toy pair and a Marian text vocabulary of its pieces, in
    tmp/marian, where random_npz puts the model."""
    tmp = tmp / "marian"
    tmp.mkdir(exist_ok=True)
    src, tgt = make_pairs(300, 1)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(src + tgt), model_prefix=str(tmp / "sp"), vocab_size=40,
        hard_vocab_limit=False, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "sp.model"))
    pieces = ["</s>", "<unk>"] + [
        sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_control(i)
        and not sp.is_unknown(i)
    ]  # fmt: skip
    return tmp / "sp.model", write_lines(tmp / "vocab.txt", pieces), pieces


def options(norm: str) -> dict:
    pre = norm == "pre"
    return {
        "type": "transformer", "dim-emb": D, "enc-depth": 2, "dec-depth": 2,
        "transformer-heads": H, "transformer-dim-ffn": FF, "transformer-ffn-depth": 2,
        "transformer-ffn-activation": "relu", "transformer-preprocess": "n" if pre else "",
        "transformer-postprocess": "da" if pre else "dan",
        "transformer-postprocess-top": "n" if pre else "", "transformer-postprocess-emb": "d",
        "tied-embeddings": True, "tied-embeddings-all": False,
    }  # fmt: skip


def random_npz(tmp: Path, norm: str, vocab: int, extra: dict | None = None) -> Path:
    """A random Marian model.npz of options(norm), with a decoder.yml beside it."""
    g = np.random.default_rng(0)
    tmp = tmp / "marian"

    def r(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (g.standard_normal(shape) * scale).astype(np.float32)

    o = options(norm) | (extra or {})
    arrays = {"encoder_Wemb": r(vocab, D), "decoder_Wemb": r(vocab, D),
              "decoder_ff_logit_out_b": r(1, vocab)}  # fmt: skip
    pre = "_pre" if norm == "pre" else ""
    for stack, blocks in (("encoder", ("self",)), ("decoder", ("self", "context"))):
        for i in (1, 2):
            for b in blocks:
                for p in "qkvo":
                    arrays[f"{stack}_l{i}_{b}_W{p}"], arrays[f"{stack}_l{i}_{b}_b{p}"] = (
                        r(D, D),
                        r(1, D),
                    )
                arrays[f"{stack}_l{i}_{b}_Wo_ln_scale{pre}"] = 1 + r(1, D)
                arrays[f"{stack}_l{i}_{b}_Wo_ln_bias{pre}"] = r(1, D)
            arrays[f"{stack}_l{i}_ffn_W1"], arrays[f"{stack}_l{i}_ffn_b1"] = r(D, FF), r(1, FF)
            arrays[f"{stack}_l{i}_ffn_W2"], arrays[f"{stack}_l{i}_ffn_b2"] = r(FF, D), r(1, D)
            arrays[f"{stack}_l{i}_ffn_ffn_ln_scale{pre}"] = 1 + r(1, D)
            arrays[f"{stack}_l{i}_ffn_ffn_ln_bias{pre}"] = r(1, D)
        if norm == "pre":
            arrays[f"{stack}_top_ln_scale"], arrays[f"{stack}_top_ln_bias"] = 1 + r(1, D), r(1, D)
    text = yaml.safe_dump(o).encode() + b"\x00"
    arrays["special:model.yml"] = np.frombuffer(text, dtype=np.int8)
    np.savez(tmp / "model.npz", **arrays)
    decoder = {"models": ["model.npz"], "vocabs": ["vocab.txt", "vocab.txt"]}
    (tmp / "decoder.yml").write_text(yaml.safe_dump(decoder))
    return tmp / "model.npz"


def reference_logprobs(npz: Path, norm: str, src: list[int], tgt: list[int]) -> torch.Tensor:
    """log p(tgt[t] | tgt[<t], src) per t, from the arrays as Marian computes them (Marian ids)."""
    a = {k: torch.from_numpy(v).float() for k, v in np.load(npz).items() if k[0] != "s"}
    pre, suf = norm == "pre", "_pre" if norm == "pre" else ""

    def ln(x, name, suffix=""):
        scale, bias = a[f"{name}_scale{suffix}"][0], a[f"{name}_bias{suffix}"][0]
        return torch.nn.functional.layer_norm(x, (D,), scale, bias)

    def attn(prefix, q_in, kv_in, causal=False):
        q, k, v = (kv @ a[f"{prefix}_W{p}"] + a[f"{prefix}_b{p}"] for p, kv in
                   (("q", q_in), ("k", kv_in), ("v", kv_in)))  # fmt: skip
        split = lambda t: t.view(t.size(0), H, D // H).transpose(0, 1)  # noqa: E731
        s = split(q) @ split(k).transpose(1, 2) / math.sqrt(D // H)
        if causal:
            s = s.masked_fill(torch.ones_like(s[0]).triu(1).bool(), float("-inf"))
        out = (s.softmax(-1) @ split(v)).transpose(0, 1).reshape(-1, D)
        return out @ a[f"{prefix}_Wo"] + a[f"{prefix}_bo"]

    def block(prefix, x, ln_name, f):
        if pre:
            return x + f(ln(x, ln_name, suf))
        return ln(x + f(x), ln_name)

    def embed(table, ids):
        pos = torch.arange(len(ids)).unsqueeze(1).float()
        div = torch.exp(torch.arange(D // 2) * (-math.log(10000.0) / (D // 2 - 1)))
        rows = torch.stack([table[i] if i >= 0 else torch.zeros(D) for i in ids])
        return rows * math.sqrt(D) + torch.cat([torch.sin(pos * div), torch.cos(pos * div)], 1)

    def ffn(prefix, x):
        return (
            torch.relu(x @ a[f"{prefix}_W1"] + a[f"{prefix}_b1"]) @ a[f"{prefix}_W2"]
            + a[f"{prefix}_b2"]
        )

    x = embed(a["encoder_Wemb"], src)
    for i in (1, 2):
        p = f"encoder_l{i}"
        x = block(p, x, f"{p}_self_Wo_ln", lambda h, p=p: attn(f"{p}_self", h, h))
        x = block(p, x, f"{p}_ffn_ffn_ln", lambda h, p=p: ffn(f"{p}_ffn", h))
    memory = ln(x, "encoder_top_ln") if pre else x
    y = embed(a["decoder_Wemb"], [-1, *tgt[:-1]])  # the start: a zero embedding
    for i in (1, 2):
        p = f"decoder_l{i}"
        y = block(p, y, f"{p}_self_Wo_ln", lambda h, p=p: attn(f"{p}_self", h, h, causal=True))
        y = block(p, y, f"{p}_context_Wo_ln", lambda h, p=p: attn(f"{p}_context", h, memory))
        y = block(p, y, f"{p}_ffn_ffn_ln", lambda h, p=p: ffn(f"{p}_ffn", h))
    y = ln(y, "decoder_top_ln") if pre else y
    logits = y @ a["decoder_Wemb"].t() + a["decoder_ff_logit_out_b"]
    return logits.log_softmax(-1).gather(1, torch.tensor(tgt).unsqueeze(1)).squeeze(1)


def attnmt_logprobs(model_dir: Path, src_text: str, tgt_text: str) -> torch.Tensor:
    tr = Translator.load(model_dir, device="cpu")
    s = tr.tokenizer.src.encode([src_text])[0] + [3]
    t = tr.tokenizer.tgt.encode([tgt_text])[0] + [3]
    x = torch.tensor([s])
    with torch.no_grad():
        logits, _ = tr.model.decode_all(tr.model.encode(x, x == 0), torch.tensor([[2, *t[:-1]]]))
    return logits[0].log_softmax(-1).gather(1, torch.tensor(t).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_a_random_marian_model_scores_as_marian_computes(tmp_path, norm, run_cli):
    sp_model, vocab_file, pieces = spm_and_vocab(tmp_path)
    npz = random_npz(tmp_path, norm, len(pieces))
    r = run_cli(
        "import", str(tmp_path / "marian"), "--out", str(tmp_path / "m"), "--spm", str(sp_model)
    )
    assert r.code == 0, r.stderr
    decode = Translator.load(tmp_path / "m").cfg.decode  # Marian's output cap, its default factor
    assert (decode.max_len_a, decode.max_len_b, decode.max_len_round) == (3.0, 0, "ceil")
    vocab = read_vocab(vocab_file)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    for src_text, tgt_text in zip(*make_pairs(5, 3), strict=True):
        ids = [[vocab[p] for p in sp.encode(t, out_type=str)] + [0] for t in (src_text, tgt_text)]
        want = reference_logprobs(npz, norm, *ids)
        got = attnmt_logprobs(tmp_path / "m", src_text, tgt_text)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_what_attnmt_cannot_express_is_refused_in_one_line(tmp_path, run_cli):
    sp_model, _, pieces = spm_and_vocab(tmp_path)
    args = ("import", str(tmp_path / "marian"), "--out", str(tmp_path / "m"))
    random_npz(tmp_path, "pre", len(pieces), {"transformer-decoder-autoreg": "rnn"})
    assert_user_error(run_cli(*args, "--spm", str(sp_model)), "autoreg = 'rnn'")
    assert not (tmp_path / "m").exists()
    random_npz(tmp_path, "pre", len(pieces), {"transformer-postprocess-emb": "dn"})
    assert_user_error(run_cli(*args, "--spm", str(sp_model)), "postprocess-emb = 'dn'")
    random_npz(tmp_path, "post", len(pieces))
    assert_user_error(run_cli(*args), "give the SentencePiece model(s) of its pieces with --spm")
    with pytest.raises(CheckpointError, match=r"no decoder\.yml"):
        native_files(tmp_path, [])


NEEDS_MARIAN = pytest.mark.skipif(
    not Path(PYMARIAN).is_file(),
    reason="no pymarian (PYMARIAN_PYTHON, or ../shared/peers: bash bench.sh setup marian)",
)
MARIAN = [PYMARIAN, "-m", "pymarian"]


def marian_trained(tmp: Path, norm: str, updates: int) -> tuple[Path, Path, Path]:
    """A tiny model trained by Marian itself on the toy pair: (model.npz, vocabulary,
    SentencePiece model)."""
    sp_model, vocab_file, _ = spm_and_vocab(tmp)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    src, tgt = make_pairs(300, 1)
    for name, lines in (("train.src", src), ("train.tgt", tgt)):
        write_lines(tmp / name, [" ".join(sp.encode(x, out_type=str)) for x in lines])
    (tmp / "model").mkdir()
    conf = options(norm) | {"max-length": 100, "after": f"{updates}u", "mini-batch": 32,
                            "learn-rate": 0.003, "seed": 1, "quiet": True}  # fmt: skip
    (tmp / "train.yml").write_text(yaml.safe_dump(conf))
    subprocess.run([*MARIAN, "train", "-c", str(tmp / "train.yml"), "--train-sets",
                    str(tmp / "train.src"), str(tmp / "train.tgt"), "--vocabs",
                    str(vocab_file), str(vocab_file), "-m", str(tmp / "model/model.npz"),
                    "--cpu-threads", "1"], check=True, capture_output=True)  # fmt: skip
    return tmp / "model/model.npz", vocab_file, sp_model


@pytest.mark.slow
@NEEDS_MARIAN
def test_a_model_trained_by_marian_scores_as_marian_scores_it(tmp_path, run_cli):
    npz, vocab_file, sp_model = marian_trained(tmp_path, "pre", 30)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    pairs = list(zip(*make_pairs(8, 4), strict=True))
    for name, side in (("s.txt", 0), ("t.txt", 1)):
        write_lines(tmp_path / name, [" ".join(sp.encode(p[side], out_type=str)) for p in pairs])
    scored = subprocess.run([*MARIAN, "score", "-m", str(npz), "-v",
                             str(vocab_file), str(vocab_file), "-t", str(tmp_path / "s.txt"),
                             str(tmp_path / "t.txt"), "--word-scores", "--cpu-threads", "1",
                             "--quiet"], check=True, capture_output=True, text=True)  # fmt: skip
    r = run_cli("import", str(npz), "--out", str(tmp_path / "m"), "--spm", str(sp_model))
    assert r.code == 0, r.stderr
    for (src_text, tgt_text), line in zip(pairs, scored.stdout.splitlines(), strict=True):
        want = torch.tensor([float(x) for x in line.split("WordScores=")[1].split()])
        torch.testing.assert_close(attnmt_logprobs(tmp_path / "m", src_text, tgt_text), want,
                                   rtol=1e-4, atol=2e-4)  # fmt: skip


@pytest.mark.slow
@NEEDS_MARIAN
def test_a_post_norm_model_trained_by_marian_decodes_as_marian_decoder(tmp_path, run_cli):
    """Greedy and beam 4, raw log-probability ranking, one sentence a batch (Marian caps a batch
    by its widest source): the same outputs under Marian's default cap (3 x source, most lines
    end) and under 0.5 x source (many lines stop at the cap, rounded up)."""
    npz, _, sp_model = marian_trained(tmp_path, "post", 40)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    sources = make_pairs(60, 7)[0]
    pieces = [sp.encode(x, out_type=str) for x in sources]
    write_lines(tmp_path / "s.txt", [" ".join(p) for p in pieces])
    write_lines(tmp_path / "s.raw", sources)
    decoder_yml = npz.with_name("model.npz.decoder.yml")
    for factor in (3, 0.5):
        decoder_yml.write_text(yaml.safe_dump(yaml.safe_load(decoder_yml.read_text()) | {
            "max-length-factor": factor}))  # fmt: skip
        r = run_cli("import", str(npz), "--out", str(tmp_path / "m"), "--spm", str(sp_model),
                    "--force")  # fmt: skip
        assert r.code == 0, r.stderr
        for beam in (1, 4):
            marian = subprocess.run([*MARIAN, "decode", "-c", str(decoder_yml), "-i",
                                     str(tmp_path / "s.txt"), "--beam-size", str(beam),
                                     "--normalize", "0", "--mini-batch", "1", "--maxi-batch",
                                     "1", "--cpu-threads", "1", "--quiet"],
                                    check=True, capture_output=True, text=True)  # fmt: skip
            out = marian.stdout.splitlines()
            capped = sum(len(o.split()) == math.ceil(factor * (len(p) + 1))
                         for o, p in zip(out, pieces, strict=True))  # fmt: skip
            assert capped > 0 if factor < 1 else capped < len(out) / 2
            r = run_cli("translate", "-m", str(tmp_path / "m"), "-i", str(tmp_path / "s.raw"),
                        "--beam", str(beam), "--length-penalty", "0")  # fmt: skip
            assert r.code == 0, r.stderr
            assert r.stdout.splitlines() == [sp.decode(line.split()) for line in out]
