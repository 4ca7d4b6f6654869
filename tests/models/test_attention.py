import pytest
import torch

from attnmt.models.attention import (
    AdditiveAttention,
    DotAttention,
    MultiHeadAttention,
    causal_mask,
    masked_softmax,
)


def copy_into_torch_mha(ours: MultiHeadAttention, theirs: torch.nn.MultiheadAttention) -> None:
    with torch.no_grad():
        if theirs._qkv_same_embed_dim:
            theirs.in_proj_weight.copy_(
                torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight])
            )
        else:
            theirs.q_proj_weight.copy_(ours.q_proj.weight)
            theirs.k_proj_weight.copy_(ours.k_proj.weight)
            theirs.v_proj_weight.copy_(ours.v_proj.weight)
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize(("kdim", "vdim"), [(None, None), (12, 20)])
@pytest.mark.parametrize("average", [True, False])
def test_multihead_matches_torch(kdim, vdim, average):
    torch.manual_seed(0)
    E, H, B, Tq, Tk = 16, 4, 3, 5, 7
    ours = MultiHeadAttention(E, H, kdim=kdim, vdim=vdim).eval()
    theirs = torch.nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, batch_first=True).eval()
    copy_into_torch_mha(ours, theirs)
    q = torch.randn(B, Tq, E)
    k = torch.randn(B, Tk, kdim or E)
    v = torch.randn(B, Tk, vdim or E)
    kpm = torch.zeros(B, Tk, dtype=torch.bool)
    kpm[0, 5:] = True
    kpm[2, 1:] = True
    attn_mask = torch.randn(Tq, Tk)  # additive float mask
    out1, w1 = ours(
        q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=average
    )
    out2, w2 = theirs(
        q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=average
    )
    torch.testing.assert_close(out1, out2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1, w2, atol=1e-6, rtol=1e-5)
    # The fused path (no weights requested) gives the same output.
    out3, w3 = ours(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
    assert w3 is None
    torch.testing.assert_close(out3, out2, atol=1e-5, rtol=1e-5)


def test_multihead_bool_causal_mask_matches_torch():
    torch.manual_seed(1)
    E, H, T = 8, 2, 6
    ours = MultiHeadAttention(E, H).eval()
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    copy_into_torch_mha(ours, theirs)
    x = torch.randn(2, T, E)
    mask = causal_mask(T)
    out1, w1 = ours(x, x, x, attn_mask=mask)
    out2, w2 = theirs(x, x, x, attn_mask=mask)
    torch.testing.assert_close(out1, out2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1, w2, atol=1e-6, rtol=1e-5)
    # causal=True on projected heads is the same computation, fused and unfused
    k, v = ours.project_kv(x, x)
    fused, _ = ours.attend(x, k, v, causal=True)
    unfused, w = ours.attend(x, k, v, causal=True, need_weights=True)
    torch.testing.assert_close(fused, out1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unfused, out1, atol=1e-5, rtol=1e-5)
    assert w is not None and torch.all(w[:, mask] == 0)


def test_masked_keys_get_exactly_zero_weight():
    torch.manual_seed(2)
    B, S, D = 2, 6, 8
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, 3:] = True
    pad[1, 5:] = True
    keys = torch.randn(B, S, D) * 50  # large scores: masking must still give exact zeros
    query = torch.randn(B, D)
    for attn in (AdditiveAttention(D, D, D), DotAttention(D, D)):
        context, w = attn(query, attn.project_keys(keys), keys, pad)
        assert context.shape == (B, D) and w.shape == (B, S)
        assert torch.all(w[pad] == 0.0)
        torch.testing.assert_close(w.sum(-1), torch.ones(B))
    mha = MultiHeadAttention(D, 2).eval()
    _, w = mha(torch.randn(B, 3, D), keys, keys, key_padding_mask=pad, average_attn_weights=False)
    assert torch.all(w.permute(0, 2, 1, 3)[pad[:, None, None, :].expand(B, 3, 2, S)] == 0.0)


def test_masked_softmax_ignores_masked_values():
    scores = torch.tensor([[1.0, 2.0, 1e9]])
    w = masked_softmax(scores, torch.tensor([[False, False, True]]))
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[1.0, 2.0, -1e30]]), -1))
    assert w[0, 2] == 0.0


def test_additive_attention_formula():
    """score = v · tanh(W_q q + W_k k), checked by hand on one example."""
    torch.manual_seed(3)
    attn = AdditiveAttention(4, 5, 3)
    q, k = torch.randn(1, 4), torch.randn(1, 2, 5)
    _, w = attn(q, attn.project_keys(k), k, torch.zeros(1, 2, dtype=torch.bool))
    Wq, bq, Wk, v = (
        attn.query_layer.weight,
        attn.query_layer.bias,
        attn.key_layer.weight,
        attn.energy_layer.weight,
    )
    scores = torch.stack([v[0] @ torch.tanh(Wq @ q[0] + bq + Wk @ k[0, j]) for j in range(2)])
    torch.testing.assert_close(w[0], torch.softmax(scores, 0))
