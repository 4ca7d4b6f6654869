from pathlib import Path

import pytest

from attnmt.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from attnmt.errors import CheckpointError

from conftest import make_pairs


def test_joint_train_save_load_round_trip(tmp_path: Path):
    src, tgt = make_pairs(200, 0)
    tok = Tokenizer.train(src, tgt, vocab_size=40, joint=True)
    assert tok.joint and tok.src is tok.tgt
    sp = tok.src.sp
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    for name, proto in tok.files().items():
        (tmp_path / name).write_bytes(proto)
    loaded = Tokenizer.load(tmp_path, joint=True)
    ids = loaded.src.encode([src[0], tgt[0]])
    assert ids == tok.src.encode([src[0], tgt[0]])
    assert loaded.tgt.decode(ids[1]) == tgt[0]


def test_separate_vocabularies(tmp_path: Path):
    src, tgt = make_pairs(200, 0)
    tok = Tokenizer.train(src, tgt, vocab_size=30, joint=False)
    assert not tok.joint
    assert set(tok.files()) == {"spm.src.model", "spm.tgt.model"}
    # Each side's vocabulary is trained on that side only.
    assert "▁t1" not in tok.src.pieces(range(len(tok.src)))
    assert "▁w1" not in tok.tgt.pieces(range(len(tok.tgt)))


def test_vocab_size_is_a_soft_limit_on_small_corpora():
    tok = Tokenizer.train(["a b", "b c"], ["x y", "y z"], vocab_size=5000, joint=True)
    assert len(tok.src) < 5000


def test_load_missing_model(tmp_path: Path):
    with pytest.raises(CheckpointError, match=r"missing SentencePiece model spm\.model"):
        Tokenizer.load(tmp_path, joint=True)


@pytest.mark.parametrize("joint", [True, False])
def test_load_reads_each_model_once(tmp_path: Path, monkeypatch, joint: bool):
    import attnmt.data.tokenizer as tokenizer

    src, tgt = make_pairs(200, 0)
    for name, proto in Tokenizer.train(src, tgt, vocab_size=40, joint=joint).files().items():
        (tmp_path / name).write_bytes(proto)
    built = []
    real = tokenizer.SubwordVocab.__init__

    def counting(self, proto):
        built.append(proto)
        real(self, proto)

    monkeypatch.setattr(tokenizer.SubwordVocab, "__init__", counting)
    loaded = Tokenizer.load(tmp_path, joint)
    assert len(built) == (1 if joint else 2)
    assert loaded.joint == joint
