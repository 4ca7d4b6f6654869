import pytest
import torch

from attnmt.models.decoding_state import ROOM, LayerCache, Room, append_position
from attnmt.models.rows import kept_order
from attnmt.models.seq2seq import AttentionSpec, sequence_loss
from attnmt.models.transformer import sinusoid_table

from helpers import V, random_batch, stepwise_logits, tiny_model


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_shapes_and_incremental_equals_full(norm):
    model = tiny_model("transformer", norm=norm).eval()
    batch = random_batch()
    B, S = batch.src.shape
    T = batch.tgt_in.size(1)
    memory = model.encode(batch.src, batch.src_pad_mask)
    assert all(k.shape == v.shape == (B, 2, S, 8) for k, v in memory.cross)  # 2 heads
    full, _ = model.decode_all(memory, batch.tgt_in)
    assert full.shape == (B, T, V)
    # The cached one-position-at-a-time decoder computes the same logits as the full pass.
    torch.testing.assert_close(
        stepwise_logits(model, batch, batch.tgt_in), full, atol=1e-5, rtol=1e-4
    )
    state = model.init_state(memory)
    logits, state, attn = model.decode_step(memory, state, batch.tgt_in[:, 0], AttentionSpec())
    assert logits.shape == (B, V) and attn.shape == (B, S) and state.position == 1
    assert torch.all(attn[batch.src_pad_mask] == 0)
    torch.testing.assert_close(attn.sum(-1), torch.ones(B))
    _, _, head0 = model.decode_step(
        memory, model.init_state(memory), batch.tgt_in[:, 0], AttentionSpec(0, 1)
    )
    assert head0.shape == (B, S)
    assert model.decode_step(memory, model.init_state(memory), batch.tgt_in[:, 0])[2] is None


def test_tied_embeddings():
    model = tiny_model("transformer")
    assert model.output.weight is model.tgt_embed.embed.weight
    assert model.src_embed.embed.weight is model.tgt_embed.embed.weight
    untied = tiny_model("transformer", tie_embeddings=False)
    assert untied.output.weight is not untied.tgt_embed.embed.weight


def test_padding_does_not_change_a_sentence():
    model = tiny_model("transformer").eval()
    batch = random_batch(B=4)
    alone = random_batch(B=4)
    # Row 0 alone (no padding) vs inside the padded batch.
    n = int((~batch.src_pad_mask[0]).sum())
    m = int((batch.tgt_out[0] != 0).sum())
    mem1 = model.encode(batch.src, batch.src_pad_mask)
    mem2 = model.encode(alone.src[:1, :n], alone.src_pad_mask[:1, :n])
    full1, _ = model.decode_all(mem1, batch.tgt_in)
    full2, _ = model.decode_all(mem2, alone.tgt_in[:1, :m])
    torch.testing.assert_close(full1[0, :m], full2[0], atol=1e-5, rtol=1e-4)


def test_scheduled_sampling_two_pass():
    model = tiny_model("transformer").eval()
    batch = random_batch()
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    gold, _n = model.loss(batch, 1.0, 0.0, g)
    assert torch.equal(g.get_state(), state), "ratio 1.0 must not draw coins (no extra cost)"
    memory = model.encode(batch.src, batch.src_pad_mask)
    full, _ = model.decode_all(memory, batch.tgt_in)
    torch.testing.assert_close(gold, sequence_loss(full, batch.tgt_out, 0.0)[0])
    # ratio 0: every input after BOS is the first pass's prediction for that position.
    sampled, _ = model.loss(batch, 0.0, 0.0, g)
    pred = full.argmax(-1)
    mixed = torch.cat([batch.tgt_in[:, :1], pred[:, :-1]], dim=1)
    expected = sequence_loss(model.decode_all(memory, mixed)[0], batch.tgt_out, 0.0)[0]
    torch.testing.assert_close(sampled, expected)
    assert not torch.isclose(sampled, gold)


def test_sinusoid_table_formula_and_offset():
    t = sinusoid_table(10, 6)
    assert t.shape == (10, 6)
    assert t[3, 2] == pytest.approx(torch.sin(torch.tensor(3 / 10000 ** (2 / 6))).item())
    assert t[3, 3] == pytest.approx(torch.cos(torch.tensor(3 / 10000 ** (2 / 6))).item())
    torch.testing.assert_close(sinusoid_table(4, 6, offset=6), t[6:10])
    assert sinusoid_table(3, 5).shape == (3, 5)  # odd widths work too


def test_positions_past_the_table_keep_the_model_dtype():
    """Positions past the precomputed 512 are computed on demand, in the model's format."""
    model = tiny_model("transformer").eval().to(torch.bfloat16)
    x = model.tgt_embed(torch.tensor([[5, 6]]), offset=600)  # (1, 2, d)
    assert x.dtype == torch.bfloat16
    ref = model.tgt_embed.embed(torch.tensor([[5, 6]])) * model.tgt_embed.scale
    pe = sinusoid_table(602, x.size(-1))[600:].to(torch.bfloat16)
    torch.testing.assert_close(x, ref + pe)


def test_selected_state_continues_as_the_selected_rows():
    """select_state only records the rows; the next step copies the caches in that order as
    it appends its position. Same logits as decoding the selected rows from the start."""
    model = tiny_model("transformer").eval()
    batch = random_batch(B=4)
    memory = model.encode(batch.src, batch.src_pad_mask)
    tokens = batch.tgt_in[:, :3]  # (4, 3)
    state = model.init_state(memory)
    with torch.no_grad():
        for t in range(2):
            _, state, _ = model.decode_step(memory, state, tokens[:, t])
        # Two selections before the next step compose: rows [2, 0, 0, 3] then [3, 1, 0].
        first, second = torch.tensor([2, 0, 0, 3]), torch.tensor([3, 1, 0])
        state = model.select_state(model.select_state(state, first), second)
        rows = first[second]  # [3, 0, 2]
        assert torch.equal(state.rows, rows)
        sub = model.select_memory(memory, rows)
        logits, state, _ = model.decode_step(sub, state, tokens[rows, 2])
        assert state.rows is None and state.caches[0].self_k.shape[:3] == (3, 2, 3)
        # Reference: the selected sentences decoded on their own.
        ref_state = model.init_state(sub)
        for t in range(3):
            ref, ref_state, _ = model.decode_step(sub, ref_state, tokens[rows, t])
    torch.testing.assert_close(logits, ref, atol=1e-6, rtol=1e-5)
    for c, r in zip(state.caches, ref_state.caches, strict=True):
        torch.testing.assert_close(c.self_k, r.self_k, atol=1e-6, rtol=1e-5)


def test_a_decoding_cache_grows_in_place_and_its_past_states_stay_valid():
    """Decoding caches take each new position in their spare room (no copy of the cache),
    past ROOM positions too; a second step from an earlier state copies instead of writing
    over the position its first step filled. Same keys as torch.cat, every time."""
    h, d = 2, 4
    cache = LayerCache(torch.zeros(3, h, 0, d), torch.zeros(3, h, 0, d), Room(
        torch.empty(3, h, ROOM, d), torch.empty(3, h, ROOM, d), 0))  # fmt: skip
    keys = torch.zeros(3, h, 0, d)
    states = []
    for _ in range(ROOM + 3):
        k = torch.randn(3, h, 1, d)
        cache = append_position(cache, k, -k, None)
        keys = torch.cat([keys, k], dim=2)
        assert torch.equal(cache.self_k, keys) and torch.equal(cache.self_v, -keys)
        states.append((cache, keys))
    assert cache.room.k.size(2) > cache.self_k.size(2)  # grown, with room again
    old, old_keys = states[4]
    branch = append_position(old, torch.ones(3, h, 1, d), torch.ones(3, h, 1, d), None)
    assert torch.equal(branch.self_k, torch.cat([old_keys, torch.ones(3, h, 1, d)], dim=2))
    later, later_keys = states[5]  # the first step from `old`: untouched by the second
    assert torch.equal(later.self_k, later_keys)
    rows = torch.tensor([2, 0])
    picked = append_position(cache, torch.ones(2, h, 1, d), torch.ones(2, h, 1, d), rows)
    assert torch.equal(picked.self_k, torch.cat([keys[rows], torch.ones(2, h, 1, d)], dim=2))
    assert picked.room.k.size(2) == picked.self_k.size(2)  # reordered rows: no room to spare
    plain = append_position(LayerCache(keys, -keys), k, -k, None)  # an exported graph's cache
    assert plain.room is None and torch.equal(plain.self_k, torch.cat([keys, k], dim=2))


def test_a_state_stepped_twice_keeps_its_first_steps_result():
    model = tiny_model("transformer").eval()
    batch = random_batch(B=3)
    memory = model.encode(batch.src, batch.src_pad_mask)
    with torch.no_grad():
        state = model.init_state(memory)
        for t in range(3):
            _, state, _ = model.decode_step(memory, state, batch.tgt_in[:, t])
        a, after_a, _ = model.decode_step(memory, state, batch.tgt_in[:, 3])
        b, _, _ = model.decode_step(memory, state, batch.tgt_in[:, 0])  # the same state again
        again, _, _ = model.decode_step(memory, after_a, batch.tgt_in[:, 4])
        fresh = model.init_state(memory)
        for t in range(5):
            ref, fresh, _ = model.decode_step(memory, fresh, batch.tgt_in[:, t])
    torch.testing.assert_close(again, ref, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(a, b)


def test_a_state_made_under_inference_mode_steps_outside_it():
    model = tiny_model("transformer").eval()
    batch = random_batch(B=2)
    with torch.inference_mode():
        memory = model.encode(batch.src, batch.src_pad_mask)
        state = model.init_state(memory)
        inside, _, _ = model.decode_step(memory, model.init_state(memory), batch.tgt_in[:, 0])
    with torch.no_grad():  # the first step of `state`: its room was made in inference mode
        outside, _, _ = model.decode_step(memory, state, batch.tgt_in[:, 0])
    torch.testing.assert_close(outside, inside)


def test_gradients_flow_through_decoding_steps():
    model = tiny_model("transformer").train()
    batch = random_batch(B=2)
    memory = model.encode(batch.src, batch.src_pad_mask)
    state = model.init_state(memory)
    total = 0.0
    for t in range(3):
        logits, state, _ = model.decode_step(memory, state, batch.tgt_in[:, t])
        total = total + logits.logsumexp(-1).sum()
    total.backward()  # no step wrote over what an earlier one's gradient needs
    assert model.decoder_layers[0].self_attn.k_proj.weight.grad is not None


def _alone(model, src, pad, tokens, n):
    """One sentence (src (S,), pad (S,)) decoded by itself over tokens[:n + 1]: the last
    step's logits (V,)."""
    memory = model.encode(src[None], pad[None])
    state = model.init_state(memory)
    for t in range(n + 1):
        logits, state, _ = model.decode_step(memory, state, tokens[None, t])
    return logits[0]


def _step_rows(model, memory, state, rows, done):
    """One step of a pool whose row i is rows[i] = (src, pad, tokens), done[i] positions in;
    checks each row's logits against the row decoded alone."""
    prev = torch.stack([tokens[n] for (_, _, tokens), n in zip(rows, done, strict=True)])
    logits, state, _ = model.decode_step(memory, state, prev)
    for i, ((src, pad, tokens), n) in enumerate(zip(rows, done, strict=True)):
        torch.testing.assert_close(
            logits[i], _alone(model, src, pad, tokens, n), atol=1e-5, rtol=1e-5
        )
        done[i] += 1
    return state


def _pool_inputs():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(4, V, (6, 7), generator=g)
    a[1, 4:] = 0  # PAD_ID
    b = torch.randint(4, V, (2, 5), generator=g)
    b[0, 3:] = 0
    return a, b, torch.randint(4, V, (6, 6), generator=g), torch.randint(4, V, (2, 5), generator=g)


def test_rows_leave_and_join_a_running_search_in_place():
    """Finished rows leave (keep_rows: the last live rows take their places) and newcomers
    join (join_memory, join_state: into the rows to spare) without a copy of the rows that
    stay: the memory and caches keep their storage, the caches drop the positions no row
    has any more, and every row decodes as it would alone."""
    model = tiny_model("transformer").eval()
    a, b, ta, tb = _pool_inputs()
    rows = [(a[r], a[r] == 0, ta[r]) for r in range(6)]
    with torch.no_grad():
        memory = model.encode(a, a == 0)
        state, done = model.init_state(memory), [0] * 6
        for _ in range(2):
            state = _step_rows(model, memory, state, rows, done)
        where = memory.cross[0][0].data_ptr(), state.caches[0].self_k.data_ptr()
        order = kept_order(torch.tensor([True, False, True, False, True, True]))
        assert order.tolist() == [0, 4, 2, 5]
        memory, state = model.keep_rows(memory, state, order)
        assert (memory.cross[0][0].data_ptr(), state.caches[0].self_k.data_ptr()) == where
        rows, done = [rows[r] for r in order.tolist()], [done[r] for r in order.tolist()]
        joining = model.encode(b, b == 0)
        memory = model.join_memory(memory, joining)
        state = model.join_state(state, model.init_state(joining))
        assert (memory.cross[0][0].data_ptr(), state.caches[0].self_k.data_ptr()) == where
        rows, done = rows + [(b[i], b[i] == 0, tb[i]) for i in range(2)], [*done, 0, 0]
        for _ in range(2):
            state = _step_rows(model, memory, state, rows, done)
        memory, state = model.keep_rows(
            memory, state, kept_order(torch.tensor([False] * 4 + [True] * 2))
        )
        assert state.caches[0].self_k.size(2) == 2  # the newcomers' own positions only
        _step_rows(model, memory, state, rows[4:], done[4:])


def test_rows_made_under_inference_mode_leave_and_join_outside_it_by_copies():
    """torch does not let inference-mode tensors be written outside it: keep_rows and the
    joins copy them instead, with the same result."""
    model = tiny_model("transformer").eval()
    a, b, ta, tb = _pool_inputs()
    rows, done = [(a[r], a[r] == 0, ta[r]) for r in range(6)], [0] * 6
    with torch.inference_mode():
        memory = model.encode(a, a == 0)
        state = _step_rows(model, memory, model.init_state(memory), rows, done)
        joining = model.encode(b, b == 0)
        new_state = model.init_state(joining)
    with torch.no_grad():
        order = kept_order(torch.tensor([False, True, True, True, True, True]))
        memory, state = model.keep_rows(memory, state, order)
        rows, done = [rows[r] for r in order.tolist()], [done[r] for r in order.tolist()]
        memory, state = model.join_memory(memory, joining), model.join_state(state, new_state)
        rows, done = rows + [(b[i], b[i] == 0, tb[i]) for i in range(2)], [*done, 0, 0]
        _step_rows(model, memory, state, rows, done)


def test_the_memory_narrows_once_its_longest_sources_leave():
    """A running search is as wide as its longest source: once that leaves, the memory is
    copied as narrow as the rows kept need (else one long line would slow the pool for as
    long as it runs), and every row decodes as it would alone."""
    model = tiny_model("transformer").eval()
    g = torch.Generator().manual_seed(1)
    a = torch.randint(4, V, (4, 12), generator=g)
    a[1:, 3:] = 0  # PAD_ID: row 0 is 12 pieces, the others 3
    tokens = torch.randint(4, V, (4, 4), generator=g)
    rows, done = [(a[r], a[r] == 0, tokens[r]) for r in range(4)], [0] * 4
    with torch.no_grad():
        memory = model.encode(a, a == 0)
        state = _step_rows(model, memory, model.init_state(memory), rows, done)
        order = kept_order(torch.tensor([False, True, True, True]))
        memory, state = model.keep_rows(memory, state, order)
        assert memory.src_mask.size(-1) == 3 and memory.cross[0][0].is_contiguous()
        rows, done = [rows[r] for r in order.tolist()], [done[r] for r in order.tolist()]
        _step_rows(model, memory, state, rows, done)
