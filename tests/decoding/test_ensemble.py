"""attnmt.decoding.ensemble and ensembles through Translator, translate, eval and serve."""

from pathlib import Path

import pytest
import torch

from attnmt import Translator
from attnmt.config import from_dict
from attnmt.decoding.ensemble import Ensemble
from attnmt.errors import AttnmtError
from attnmt.training.loop import train

from conftest import make_pairs, tiny_config

LINES = make_pairs(24, 13)[0]


@pytest.fixture(scope="module")
def rnn_model(trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny rnn model trained on conftest's corpus with the same tokenizer settings and
    seed, so the same SentencePiece model, as conftest's transformer."""
    _, corpus = trained
    raw = tiny_config(corpus, "rnn")
    raw["train"].update(max_steps=6, eval_every=3)
    out = tmp_path_factory.mktemp("rnn") / "m"
    train(from_dict(raw), out, quiet=True)
    return out


def test_an_ensemble_of_a_model_with_itself_is_that_model(trained):
    model, _ = trained
    one = Translator.load(model, device="cpu")
    two = Translator.load([model, model], device="cpu")
    assert isinstance(two.model, Ensemble) and len(two.model.models) == 2
    for beam in (1, 3):
        assert two.translate(LINES, beam=beam) == one.translate(LINES, beam=beam)
    a, b = (t.hypotheses(LINES[:5], beam=3, n_best=3) for t in (one, two))
    assert [[h.text for h in r] for r in a] == [[h.text for h in r] for r in b]
    for x, y in zip(a, b, strict=True):
        assert [h.score for h in x] == pytest.approx([h.score for h in y], abs=1e-5)
    spec = one.attention_spec()
    (ra,), (rb,) = (t.search(LINES[:1], t.options(beam=2, attention=spec)) for t in (one, two))
    torch.testing.assert_close(ra[0].attention, rb[0].attention)


def test_a_mixed_ensemble_decodes_in_any_order_batch_and_workers(trained, rnn_model):
    model, _ = trained
    mixed = Translator.load([model, rnn_model], device="cpu")
    for beam in (1, 3):
        ref = mixed.translate(LINES, beam=beam, batch_tokens=10_000)
        assert len(ref) == len(LINES)
        assert mixed.translate(LINES, beam=beam, batch_tokens=30) == ref
        assert mixed.translate(LINES[::-1], beam=beam)[::-1] == ref
        assert mixed.translate(LINES, beam=beam, batch_tokens=30, workers=2) == ref


def test_the_ensemble_step_is_the_mean_of_the_models_log_probabilities(trained, rnn_model):
    from attnmt.data.batches import pad_sequences
    from attnmt.data.tokenizer import EOS_ID, PAD_ID

    mixed = Translator.load([trained[0], rnn_model], device="cpu")
    ids = [[*s, EOS_ID] for s in mixed.tokenizer.src.encode(LINES[:4])]
    src = pad_sequences(ids, PAD_ID)  # (4, S)
    mask = src == PAD_ID
    prev = torch.full((4,), mixed.model.bos_id)
    with torch.no_grad():
        memory = mixed.model.encode(src, mask)
        mean, _, _ = mixed.model.decode_step(memory, mixed.model.init_state(memory), prev)
        each = []
        for m in mixed.model.models:
            mem = m.encode(src, mask)
            logits, _, _ = m.decode_step(mem, m.init_state(mem), prev)
            each.append(torch.log_softmax(logits.float(), dim=-1))
    torch.testing.assert_close(mean, (each[0] + each[1]) / 2)


def test_models_with_other_vocabularies_are_one_line(trained, tmp_path: Path, run_cli):
    model, corpus = trained
    raw = tiny_config(corpus)
    raw["tokenizer"]["model_type"] = "bpe"  # another SentencePiece model
    raw["train"].update(max_steps=2, eval_every=2)
    train(from_dict(raw), tmp_path / "other", quiet=True)
    with pytest.raises(AttnmtError, match=r"an ensemble needs one vocabulary: .*spm\.model"):
        Translator.load([model, tmp_path / "other"], device="cpu")
    r = run_cli("translate", "-m", str(model), "-m", str(tmp_path / "other"), stdin=b"w1\n")
    assert r.code == 2 and "an ensemble needs one vocabulary" in r.stderr


def test_the_cli_and_eval_take_several_models(trained, run_cli, tmp_path: Path):
    model, corpus = trained
    text = "".join(f"{line}\n" for line in LINES).encode()
    one = run_cli("translate", "-m", str(model), "--beam", "2", stdin=text)
    two = run_cli("translate", "-m", str(model), "-m", str(model), "--beam", "2", stdin=text)
    assert one.code == two.code == 0 and one.stdout == two.stdout
    args = ["--src", str(corpus["dev_src"]), "--ref", str(corpus["dev_tgt"]), "--json"]
    e1 = run_cli("eval", "-m", str(model), *args)
    e2 = run_cli("eval", "-m", str(model), "-m", str(model), *args)
    assert e1.code == e2.code == 0 and e1.stdout == e2.stdout
