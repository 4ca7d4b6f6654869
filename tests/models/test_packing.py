"""Sentences packed one after another for the encoder (serve's newcomers) encode as they do
padded, position by position."""

import pytest
import torch

from attnmt.models.packing import Packing

from helpers import V, tiny_model


def padded_batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)  # PAD_ID 0
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(4, V, (n,), generator=g)
    return src, src == 0


@pytest.mark.parametrize(
    "kw", [{}, {"norm": "post"}, {"positions": "rope"}], ids=["pre", "post", "rope"]
)
def test_packed_sentences_encode_as_padded_ones(kw):
    model = tiny_model("transformer", **kw).eval()
    src, pad = padded_batch([3, 9, 1, 5, 2, 8, 4])
    packing = Packing.of(pad, width=12)
    assert packing is not None and packing.positions.shape == (3, 12)  # 63 positions -> 36
    with torch.no_grad():
        want, got = model.encode(src, pad), model.encode_packed(src, pad, packing)
    torch.testing.assert_close(got.src_mask, want.src_mask)
    real = ~pad
    for pair, packed in zip(want.cross, got.cross, strict=True):
        for w, g in zip(pair, packed, strict=True):  # (B, h, S, d_h)
            torch.testing.assert_close(g.transpose(1, 2)[real], w.transpose(1, 2)[real])
            assert not g.transpose(1, 2)[~real].any()  # padding: zeros, masked


def test_a_batch_with_little_padding_is_not_packed():
    _, pad = padded_batch([7, 8, 8, 9])
    assert Packing.of(pad) is None  # 32 of 36 positions are words
    _, pad = padded_batch([1, 1, 1, 9])
    packing = Packing.of(pad)
    assert packing is not None and packing.positions.tolist() == [[0, 0, 0, *range(9)]]
    # each sentence sees itself only
    allowed = packing.mask[0, 0] == 0  # (12, 12)
    assert allowed[:3, :3].equal(torch.eye(3, dtype=torch.bool)) and allowed[3:, 3:].all()
    assert not allowed[:3, 3:].any()
