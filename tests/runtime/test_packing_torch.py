"""A pack's layout and its attention, in one process: rows laid end to end with
positions restarting, outputs gathered back to the padded layout, and both attention
kernels equal to each row's own causal attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from realign.data.packing import call_padding, inference_packs, make_pack, train_packs
from realign.runtime.engines.packed_attention import kernel_for, packed_attention

pytestmark = pytest.mark.torch


def batch():
    tokens = torch.arange(1, 41).view(4, 10)
    return tokens, torch.tensor([10, 3, 6, 1])


def test_make_pack_lays_rows_end_to_end():
    tokens, lengths = batch()
    p = make_pack(tokens, lengths, [[2, 1], [0, 3]], 16, "segments")
    assert p.tokens[0, :9].tolist() == tokens[2, :6].tolist() + tokens[1, :3].tolist()
    assert p.tokens[0, 9:].eq(0).all()
    assert p.positions[0, :9].tolist() == list(range(6)) + list(range(3))
    assert p.doc[1, :12].tolist() == [0] * 10 + [1, -1]
    assert p.segments == [[(0, 6), (6, 3)], [(0, 10), (10, 1)]]
    assert p.rows.tolist() == [2, 1, 0, 3] and p.padded_tokens() == 32 - 20
    # unpacking the pack's own tokens gives the padded rows, zero past each length
    back = p.unpack(p.tokens.float(), 10)
    valid = torch.arange(10) < lengths[p.rows].unsqueeze(1)
    assert torch.equal(back, (tokens[p.rows] * valid).float())
    shifted = p.unpack(p.tokens.float(), 9, shift=1)
    assert shifted[1].tolist() == tokens[1, :2].tolist() + [0] * 7


def test_inference_and_train_packs():
    tokens, lengths = batch()
    packs = inference_packs(tokens, lengths, 2, "segments")
    assert len(packs) <= 2 and {p.shape for p in packs} == {(1, 16)}
    assert sorted(r for p in packs for r in p.rows.tolist()) == [0, 1, 2, 3]
    micro = [{"tokens": tokens[:2], "lengths": lengths[:2]},
             {"tokens": tokens[2:], "lengths": lengths[2:]}]
    packs = train_packs(micro, "segments")
    assert [p.rows.tolist() for p in packs] == [[0, 1], [0, 1]]   # each micro-batch's own
    assert {p.shape for p in packs} == {(1, 16)}                   # 13 tokens at most
    assert call_padding(lengths, 10, 1, 2, "train", True) == 32 - 20
    assert call_padding(lengths, 10, 1, 2, "train", False) == 40 - 20
    assert call_padding(lengths, 10, 1, 2, "inference", True) == 32 - 20


def test_inference_packs_by_a_token_budget():
    tokens, lengths = batch()                       # lengths 10, 3, 6, 1
    packs = inference_packs(tokens, lengths, 1, "segments", token_budget=16)
    assert [p.rows.tolist() for p in packs] == [[0, 2], [1, 3]]     # as many bins as it takes
    assert {p.shape for p in packs} == {(1, 16)}
    one = inference_packs(tokens, lengths, 4, "segments", token_budget=48)
    assert len(one) == 1 and one[0].shape == (1, 32)     # the fullest bin's width, not 48
    with pytest.raises(ValueError, match="exceeds"):
        inference_packs(tokens, lengths, 1, "segments", token_budget=8)
    # the metric counts exactly what the packs compute, rank by rank
    for budget in (16, 32, 48):
        for dp in (1, 2):
            per = 4 // dp
            want = sum(sum(p.padded_tokens() for p in inference_packs(
                tokens[d * per:(d + 1) * per], lengths[d * per:(d + 1) * per], 1, "segments",
                token_budget=budget)) for d in range(dp))
            assert call_padding(lengths, 10, dp, 3, "inference", True, budget) == want
    assert call_padding(lengths, 10, 1, 1, "inference", True, 16) == 32 - 20


@pytest.mark.parametrize("kernel", ["segments", "flex"])
def test_packed_attention_is_each_rows_own_causal_attention(kernel):
    if kernel == "flex":
        pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(0)
    tokens = torch.zeros(5, 20, dtype=torch.long)
    lengths = torch.tensor([20, 7, 3, 11, 1])
    p = make_pack(tokens, lengths, [[0], [3, 1, 4], [2]], 32, kernel)
    q = torch.randn(3, 4, 32, 8, generator=g)
    k, v = torch.randn(3, 2, 32, 8, generator=g), torch.randn(3, 2, 32, 8, generator=g)
    # FlexAttention has no CPU backward (its eager path runs here without autograd)
    with torch.no_grad():
        out = packed_attention(q, k, v, p, 0.3, True)
    for j, segs in enumerate(p.segments):
        for a, n in segs:
            ref = F.scaled_dot_product_attention(
                q[j:j + 1, :, a:a + n], k[j:j + 1, :, a:a + n], v[j:j + 1, :, a:a + n],
                is_causal=True, scale=0.3, enable_gqa=True)
            assert torch.allclose(out[j:j + 1, :, a:a + n], ref, atol=1e-5)
    assert kernel_for("cuda") == "flex" and kernel_for("cpu") == "segments"


def test_segments_kernel_has_a_backward():
    tokens = torch.zeros(2, 6, dtype=torch.long)
    p = make_pack(tokens, torch.tensor([6, 4]), [[0, 1]], 16, "segments")
    q = torch.randn(1, 2, 16, 4, requires_grad=True)
    out = packed_attention(q, q.detach()[:, :1], q.detach()[:, :1], p, 0.5, True)
    out.sum().backward()
    assert q.grad[:, :, :10].abs().sum() > 0 and q.grad[:, :, 10:].eq(0).all()
