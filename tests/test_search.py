import pytest
import torch

from attnmt.search import greedy_search, max_output_lengths

from models import random_batch, tiny_model


def test_max_output_lengths():
    pad = torch.tensor([[False, False, False, True], [False, True, True, True]])
    assert max_output_lengths(pad, 1.5, 2).tolist() == [6, 3]


@pytest.mark.parametrize("arch", ["rnn", "transformer"])
def test_greedy_batched_equals_one_by_one(arch):
    model = tiny_model(arch, seed=4).eval()
    batch = random_batch(seed=5, B=6)
    together = greedy_search(model, batch.src, batch.src_pad_mask, 2.0, 3)
    for i in range(6):
        n = int((~batch.src_pad_mask[i]).sum())
        alone = greedy_search(
            model, batch.src[i : i + 1, :n], batch.src_pad_mask[i : i + 1, :n], 2.0, 3
        )
        assert alone[0] == together[i]
    limits = max_output_lengths(batch.src_pad_mask, 2.0, 3)
    for hyp, limit in zip(together, limits.tolist(), strict=True):
        assert len(hyp) <= limit
        assert model.eos_id not in hyp


def test_greedy_is_argmax_chain():
    model = tiny_model("transformer", seed=6).eval()
    batch = random_batch(seed=7, B=1)
    hyp = greedy_search(model, batch.src, batch.src_pad_mask, 3.0, 5)[0]
    memory = model.encode(batch.src, batch.src_pad_mask)
    state = model.init_state(memory)
    prev, expected = torch.tensor([model.bos_id]), []
    for _ in range(len(hyp) + 1):
        logits, state, _ = model.decode_step(memory, state, prev)
        prev = logits.argmax(-1)
        if int(prev) == model.eos_id:
            break
        expected.append(int(prev))
    assert hyp == expected[: len(hyp)]
