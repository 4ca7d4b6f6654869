import gzip
from pathlib import Path

import pytest
import torch

from attnmt.data.batches import BucketSampler, collate, token_batches
from attnmt.data.text import read_lines, read_parallel
from attnmt.errors import DataError


def test_counts_must_match(tmp_path: Path):
    (tmp_path / "a").write_text("x\ny\nz\n")
    (tmp_path / "b").write_text("x\ny\n")
    with pytest.raises(DataError) as e:
        read_parallel(tmp_path / "a", tmp_path / "b")
    msg = str(e.value)
    assert str(tmp_path / "a") in msg and str(tmp_path / "b") in msg
    assert "3 lines" in msg and "has 2" in msg


def test_bad_utf8_names_file_and_line(tmp_path: Path):
    (tmp_path / "a").write_bytes(b"ok\nfine\nbad \xff byte\n")
    with pytest.raises(DataError, match=r"/a:3: not valid UTF-8 \(byte 0xff at column 5\)"):
        read_lines(tmp_path / "a")


def test_missing_file(tmp_path: Path):
    with pytest.raises(DataError, match="file not found"):
        read_lines(tmp_path / "nope")


def test_gzip_crlf_and_unicode_line_separators(tmp_path: Path):
    # U+2028 and form feed are characters inside a line; only \n ends one.
    data = "eins\r\nzwei\u2028drei\nvier\x0cfünf\n".encode()
    with gzip.open(tmp_path / "a.gz", "wb") as f:
        f.write(data)
    assert read_lines(tmp_path / "a.gz") == ["eins", "zwei\u2028drei", "vier\x0cfünf"]


def test_empty_sides_skip_the_whole_pair_and_keep_alignment(tmp_path: Path):
    (tmp_path / "s").write_text("s1\n\ns3\ns4\n   \ns6\n")
    (tmp_path / "t").write_text("t1\nt2\n\nt4\nt5\nt6\n")
    text = read_parallel(tmp_path / "s", tmp_path / "t")
    assert list(zip(text.src, text.tgt, strict=True)) == [("s1", "t1"), ("s4", "t4"), ("s6", "t6")]
    assert text.skipped_empty == 3


def test_collate_shapes_and_specials():
    b = collate([[5, 6], [7]], [[8], [9, 10, 11]], [0, 1], pad_id=0, bos_id=2, eos_id=3)
    assert b.src.tolist() == [[5, 6, 3], [7, 3, 0]]
    assert b.src_pad_mask.tolist() == [[False, False, False], [False, False, True]]
    assert b.tgt_in.tolist() == [[2, 8, 0, 0], [2, 9, 10, 11]]
    assert b.tgt_out.tolist() == [[8, 3, 0, 0], [9, 10, 11, 3]]
    assert b.n_tokens == 6


def test_token_batches_respect_budget():
    lengths = [3, 5, 2, 8, 8, 1, 4]
    batches = token_batches(lengths, 10, range(len(lengths)))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 10


def test_sampler_is_deterministic_covers_everything_and_reshuffles():
    tgt = [(i * 7) % 13 + 1 for i in range(200)]
    src = [t + i % 3 for i, t in enumerate(tgt)]  # correlated with tgt, as in real corpora
    s = BucketSampler(src, tgt, batch_tokens=40, seed=3, bucket_batches=4)
    e1, e1_again, e2 = s.epoch(1).as_lists(), s.epoch(1).as_lists(), s.epoch(2).as_lists()
    assert e1 == e1_again
    assert e1 != e2
    assert sorted(i for b in e1 for i in b) == list(range(200))
    # Bucketing keeps padding low on both sides: most padded positions are real tokens.
    for side in (src, tgt):
        real = sum(side)
        padded = sum(max(side[i] for i in b) * len(b) for b in e1)
        assert real / padded > 0.8
    # A batch's size counts the longer side of each pair.
    longer = [max(s_, t) for s_, t in zip(src, tgt, strict=True)]
    assert all(len(b) == 1 or max(longer[i] for i in b) * len(b) <= 40 for b in e1)


def _reference_epoch(s: BucketSampler, epoch: int) -> list[list[int]]:
    """The sampler's epoch as plain Python: sort each chunk, cut with token_batches."""
    g = torch.Generator().manual_seed(s.seed * 1_000_003 + epoch)
    lengths, tgt = s.lengths.tolist(), s.tgt_lengths.tolist()
    perm = torch.randperm(len(lengths), generator=g).tolist()
    per_batch = s.batch_tokens // max(1, sum(lengths) // len(lengths))
    if s.max_sentences is not None:
        per_batch = min(per_batch, s.max_sentences)
    chunk, batches = max(1, s.bucket_batches * per_batch), []
    for start in range(0, len(perm), chunk):
        part = sorted(perm[start : start + chunk], key=lambda i: (lengths[i], tgt[i]))
        batches.extend(token_batches(lengths, s.batch_tokens, part, s.max_sentences))
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


@pytest.mark.parametrize("max_sentences", [None, 5])
def test_vectorised_sampler_equals_the_plain_one(max_sentences):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(1, 30, (3000,), generator=g).tolist()
    noise = torch.randint(-3, 4, (3000,), generator=g).tolist()
    tgt = [max(1, x + d) for x, d in zip(src, noise, strict=True)]
    src[7] = 500  # longer than a batch: a batch of its own
    s = BucketSampler(src, tgt, 120, seed=5, bucket_batches=3, max_sentences=max_sentences)
    for epoch in (1, 2):
        assert s.epoch(epoch).as_lists() == _reference_epoch(s, epoch)


def test_sampler_caps_sentences_per_batch():
    lengths = [3] * 100
    s = BucketSampler(lengths, lengths, batch_tokens=10_000, seed=1, max_sentences=16)
    batches = s.epoch(1)
    assert max(len(b) for b in batches) == 16
    assert sorted(i for b in batches for i in b) == list(range(100))


def test_line_counting(tmp_path: Path):
    for data, lines in [
        (b"", []),
        (b"\n", [""]),
        (b"a", ["a"]),
        (b"a\n", ["a"]),
        (b"\n\n", ["", ""]),
    ]:
        (tmp_path / "f").write_bytes(data)
        assert read_lines(tmp_path / "f") == lines, data


def test_shape_buckets_are_few_and_at_most_a_quarter_larger():
    from attnmt.data.batches import shape_bucket

    sizes = {shape_bucket(n) for n in range(1, 2049)}
    assert sorted(sizes)[:10] == [8, 10, 12, 14, 16, 20, 24, 28, 32, 40]
    assert len(sizes) == 33  # 8..2048: four sizes an octave
    assert all(n <= shape_bucket(n) <= max(8, 1.25 * n) for n in range(1, 2049))


def test_padding_to_a_bucket_changes_no_loss_or_gradient():
    from attnmt.config import ModelConfig
    from attnmt.data.batches import pad_to_bucket
    from attnmt.models.build import build_model

    torch.manual_seed(0)
    src = [[5, 6, 7], [8, 9], [5, 5, 5, 6, 7, 8, 9, 10, 11]]
    tgt = [[12, 13], [14, 15, 16, 17], [12]]
    batch = collate(src, tgt, [0, 1, 2], pad_id=0, bos_id=1, eos_id=2)
    grown = pad_to_bucket(batch, bos_id=1, eos_id=2)
    assert grown.src.shape == (8, 10) and grown.tgt_in.shape == (8, 8)
    assert grown.n_tokens == batch.n_tokens and grown.src[3:, 0].eq(2).all()
    cfg = ModelConfig(arch="transformer", hidden_size=16, heads=2, ff_size=32, enc_layers=1,
                      dec_layers=1, dropout=0.0, attention_dropout=0.0)  # fmt: skip
    model = build_model(cfg, 20, 20, joint=True)
    results = []
    for b in (batch, grown):
        model.zero_grad()
        loss, n = model.loss(b, 1.0, 0.1)
        loss.backward()
        results.append((loss.detach(), int(n), [p.grad.clone() for p in model.parameters()]))
    (l1, n1, g1), (l2, n2, g2) = results
    assert n1 == n2 and l1 == pytest.approx(float(l2), rel=1e-5)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_prefetcher_gives_what_make_gives_and_makes_ahead():
    from attnmt.data.batches import Prefetcher

    made = []

    def make(idxs):
        made.append(idxs)
        return [collate([[5] * len(i)], [[6]], i, 0, 1, 2) for i in idxs]

    prefetch = Prefetcher(make, enabled=True)
    prefetch.ahead([[1, 2]])
    first = prefetch.get([[1, 2]])  # made ahead: not made again
    assert made == [[[1, 2]]] and first[0].src.tolist() == [[5, 5, 2]]
    prefetch.ahead([[3]])
    assert prefetch.get([[4]])[0].index == [4]  # asked for other batches: made now
    prefetch.close()  # [[3]], unused, was made meanwhile or cancelled
    assert made[0] == [[1, 2]] and [[4]] in made and len(made) <= 3
