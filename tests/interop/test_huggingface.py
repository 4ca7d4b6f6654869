"""attnmt import: tiny random MarianMTModels built with transformers (no network), saved as
Hugging Face saves them, imported, and compared with transformers' own forward and generate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import sentencepiece as spm  # noqa: E402

from attnmt import Translator  # noqa: E402
from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID  # noqa: E402
from attnmt.decoding.search import Beam, Greedy, SearchOptions  # noqa: E402
from attnmt.decoding.translate import search_lines  # noqa: E402
from attnmt.interop.huggingface import model_rows  # noqa: E402

from conftest import make_pairs  # noqa: E402
from helpers import one_error_line  # noqa: E402

SOURCES = make_pairs(60, 11)[0]


def train_spm(lines: list[str], prefix: Path) -> Path:
    """A SentencePiece model as Marian's are made: unk 0, bos 1, eos 2, no pad."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=40,
        hard_vocab_limit=False, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    return prefix.with_suffix(".model")


def marian_dir(tmp: Path, activation: str, tied: bool, two_spm: bool, seed: int = 0) -> Path:
    """A random MarianMTModel directory: config.json, model.safetensors, source.spm,
    target.spm (the same file unless two_spm) and vocab.json (</s> 0, <unk> 1, <pad> last)."""
    src, tgt = make_pairs(300, 1)
    src_spm = train_spm(src + (tgt if not two_spm else []), tmp / "src")
    tgt_spm = train_spm(tgt, tmp / "tgt") if two_spm else src_spm
    pieces: list[str] = []
    for path in dict.fromkeys([src_spm, tgt_spm]):
        sp = spm.SentencePieceProcessor(model_file=str(path))
        pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_control(i)]
    vocab = {"</s>": 0, "<unk>": 1}
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    vocab["<pad>"] = len(vocab)
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, activation_function=activation, pad_token_id=vocab["<pad>"],
        eos_token_id=0, decoder_start_token_id=vocab["<pad>"], max_position_embeddings=128,
        scale_embedding=True, dropout=0.0, attention_dropout=0.0, init_std=1.0,
        share_encoder_decoder_embeddings=tied, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.5)
        model.final_logits_bias[0, 0] += 3.0  # </s>: the random model's lines end here and there
    out = tmp / "hf"
    model.save_pretrained(out, safe_serialization=True)
    shutil.copy(src_spm, out / "source.spm")
    shutil.copy(tgt_spm, out / "target.spm")
    (out / "vocab.json").write_text(json.dumps(vocab))
    return out


def marian_ids(translator: Translator, hf: Path) -> tuple[list[int], list[int], dict[int, str]]:
    """attnmt id -> model id for source and target, and model id -> piece."""
    vocab = json.loads((hf / "vocab.json").read_text())
    pad = vocab["<pad>"]
    special = {PAD_ID: pad, BOS_ID: pad, EOS_ID: 0, UNK_ID: 1}
    src_rows, _ = model_rows(translator.tokenizer.src, vocab, special)
    tgt_rows, _ = model_rows(translator.tokenizer.tgt, vocab, special)
    return src_rows, tgt_rows, {i: p for p, i in vocab.items()}


class TargetOnly:
    """A logits processor: log-probabilities renormalised over the target pieces' ids (the
    pad id among them), then the pad id banned, as Marian's bad_words_ids ban it."""

    def __init__(self, vocab_size: int, target: set[int], pad: int) -> None:
        self.others = torch.tensor(
            sorted(set(range(vocab_size)) - target - {pad}), dtype=torch.long
        )
        self.pad = pad

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.index_fill(1, self.others, -torch.inf).log_softmax(dim=-1)
        return scores.index_fill(1, torch.tensor([self.pad]), -torch.inf)


CASES = [("swish", True, False), ("relu", False, True), ("swish", False, False)]


@pytest.mark.parametrize(("activation", "tied", "two_spm"), CASES)
def test_imported_marian_model_equals_transformers(tmp_path, run_cli, activation, tied, two_spm):
    hf_dir = marian_dir(tmp_path, activation, tied, two_spm)
    out = tmp_path / "imported"
    r = run_cli("import", str(hf_dir), "--out", str(out))
    assert r.code == 0, r.stderr
    translator = Translator.load(out, device="cpu")
    hf = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
    src_rows, tgt_rows, pieces = marian_ids(translator, hf_dir)
    tok, model = translator.tokenizer, translator.model

    # 1. Logits, teacher-forced: equal over the target pieces (relative 1e-4), but for the
    # start token's, which the import keeps out of the output (bias -100).
    src = [[*ids, EOS_ID] for ids in tok.src.encode(SOURCES[:8])]
    tgt = [[BOS_ID, *ids] for ids in tok.tgt.encode(make_pairs(8, 11)[1])]
    for s, t in zip(src, tgt, strict=True):
        s_t, t_t = torch.tensor([s]), torch.tensor([t])
        with torch.no_grad():
            ours, _ = model.decode_all(model.encode(s_t, s_t == PAD_ID), t_t)  # (1, T, V)
            theirs = hf(
                input_ids=torch.tensor([[src_rows[i] for i in s]]),
                decoder_input_ids=torch.tensor([[tgt_rows[i] for i in t]]),
            ).logits[..., tgt_rows]
        keep = [i for i in range(ours.size(-1)) if i != BOS_ID]  # the start token: no output
        torch.testing.assert_close(ours[..., keep], theirs[..., keep], rtol=1e-4, atol=1e-4)

    # 2. Greedy and beam 4 on 60 sentences: the same output as generate, same limits. attnmt's
    # softmax covers the target pieces (with two SentencePiece models, vocab.json also holds
    # source-only pieces, which transformers normalises over too): TargetOnly makes generate
    # do the same, so that beam scores compare.
    sp_tgt = spm.SentencePieceProcessor(model_file=str(hf_dir / "target.spm"))
    only = TargetOnly(hf.config.vocab_size, set(tgt_rows), hf.config.pad_token_id)
    processors = transformers.LogitsProcessorList([only])
    for beam in (1, 4):
        method = Greedy() if beam == 1 else Beam(beam, length_penalty=0.0)
        options = SearchOptions(method, max_len_a=0.0, max_len_b=20, scores=False)
        ours = [r[0].text for r in search_lines(model, tok, SOURCES, options, batch_tokens=4000)]
        theirs = []
        for s in tok.src.encode(SOURCES):
            found = hf.generate(
                torch.tensor([[src_rows[i] for i in [*s, EOS_ID]]]), num_beams=beam,
                do_sample=False, max_new_tokens=20, length_penalty=0.0, forced_eos_token_id=None,
                logits_processor=processors,
            )[0].tolist()  # fmt: skip
            words = [pieces[i] for i in found[1:] if i != 0 and i != hf.config.pad_token_id]
            theirs.append(sp_tgt.decode_pieces(words))
        differ = [(i, a, b) for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
        assert not differ, f"beam {beam}: {len(differ)} of {len(ours)} differ: {differ[:3]}"


def test_an_imported_model_fine_tunes_and_refuses_what_it_cannot_express(tmp_path, run_cli, corpus):
    from conftest import tiny_config, write_config

    hf_dir = marian_dir(tmp_path, "swish", True, False)
    out = tmp_path / "imported"
    assert run_cli("import", str(hf_dir), "--out", str(out)).code == 0
    assert run_cli("import", str(hf_dir), "--out", str(out)).code == 2  # exists: --force
    assert run_cli("import", str(hf_dir), "--out", str(out), "--force").code == 0
    lines = ["w1 w2 w3", "w4 w5"]
    found = run_cli("translate", "-m", str(out), stdin="".join(f"{x}\n" for x in lines).encode())
    assert found.code == 0 and len(found.stdout.splitlines()) == 2
    # CTranslate2 runs it too (post-norm, swish or relu, Marian's position table, output bias).
    check = tmp_path / "check.txt"
    check.write_text("".join(f"{x}\n" for x in SOURCES[:20]))
    r = run_cli("export", str(out), str(tmp_path / "ct2"), "--check", str(check))
    assert r.code == 0 and "20/20 identical" in r.stdout, r.stderr
    raw = tiny_config(corpus)
    del raw["model"], raw["tokenizer"]
    raw["train"].update(init_from=str(out), max_steps=3, eval_every=3)
    tuned = tmp_path / "tuned"
    r = run_cli("train", "-c", str(write_config(tmp_path / "c.yaml", raw)), "--out", str(tuned))
    assert r.code == 0, r.stderr
    assert json.loads((tuned / "attnmt.json").read_text())["model"]["activation"] == "swish"
    config = json.loads((hf_dir / "config.json").read_text())
    config["decoder_ffn_dim"] = 64
    (hf_dir / "config.json").write_text(json.dumps(config))
    from helpers import attnmt

    bad = attnmt("import", str(hf_dir), "--out", str(tmp_path / "x"))
    one_error_line(bad, "decoder_ffn_dim = 64", "one feed-forward width")
    assert not (tmp_path / "x").exists()


def test_export_to_huggingface_round_trips(tmp_path, run_cli, trained):
    hf_dir = marian_dir(tmp_path, "swish", True, False, seed=3)
    imported, exported, again = tmp_path / "imported", tmp_path / "hf_out", tmp_path / "again"
    assert run_cli("import", str(hf_dir), "--out", str(imported)).code == 0
    r = run_cli("export", "--format", "huggingface", str(imported), str(exported))
    assert r.code == 0, r.stderr
    hf = transformers.MarianMTModel.from_pretrained(exported).eval()
    translator = Translator.load(imported, device="cpu")
    tok = translator.tokenizer
    options = SearchOptions(Greedy(), max_len_a=0.0, max_len_b=20, scores=False)
    ours = search_lines(translator.model, tok, SOURCES, options, batch_tokens=4000)
    for s, found in zip(tok.src.encode(SOURCES), ours, strict=True):
        out = hf.generate(
            torch.tensor([[*s, EOS_ID]]), num_beams=1, do_sample=False, max_new_tokens=20,
            forced_eos_token_id=None,
        )[0].tolist()  # fmt: skip
        assert tok.tgt.decode([i for i in out[1:] if i != EOS_ID]) == found[0].text
    # attnmt reads its own export back: the same translations.
    assert run_cli("import", str(exported), "--out", str(again)).code == 0
    lines = "".join(f"{x}\n" for x in SOURCES[:20]).encode()
    first = run_cli("translate", "-m", str(imported), "--beam", "4", stdin=lines).stdout
    assert run_cli("translate", "-m", str(again), "--beam", "4", stdin=lines).stdout == first
    trained_pre_norm = run_cli(
        "export", "--format", "huggingface", str(hf_dir), str(tmp_path / "x")
    )
    assert trained_pre_norm.code == 2  # not an attnmt model directory: one line


def test_import_and_export_never_write_onto_what_they_read(tmp_path, run_cli, trained):
    hf_dir = marian_dir(tmp_path, "relu", True, False)
    r = run_cli("import", str(hf_dir), "--out", str(hf_dir), "--force")
    assert r.code == 2 and "is, holds or is inside the model directory" in r.stderr
    assert (hf_dir / "config.json").is_file()  # untouched
    model = trained[0]
    r = run_cli("export", "--format", "huggingface", str(model), str(model / "hf"), "--force")
    assert r.code == 2 and "is, holds or is inside the model directory" in r.stderr
