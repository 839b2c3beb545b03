"""The packed attention's CUDA kernel (compiled FlexAttention with a per-row block mask):
forward and backward equal to each row's own causal attention. Run with `pytest -m gpu`
on a CUDA machine (it has not run on the CPU-only machines where realign is built)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from realign.data.packing import make_pack
from realign.runtime.engines.packed_attention import packed_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_flex_kernel_forward_and_backward_are_per_row_attention(dtype, tol):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    lengths = torch.tensor([300, 7, 129, 64, 1, 200], device=dev)
    tokens = torch.zeros(6, 300, dtype=torch.long, device=dev)
    pack = make_pack(tokens, lengths, [[0, 1], [2, 3, 4], [5]], 384, "flex")
    q = torch.randn(3, 8, 384, 64, generator=g, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(3, 2, 384, 64, generator=g, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(3, 2, 384, 64, generator=g, device=dev, dtype=dtype, requires_grad=True)
    out = packed_attention(q, k, v, pack, 0.125, True)
    segments = make_pack(tokens, lengths, [[0, 1], [2, 3, 4], [5]], 384, "segments")
    seg = packed_attention(q, k, v, segments, 0.125, True)
    used = torch.zeros(3, 384, dtype=torch.bool, device=dev)
    for j, segs in enumerate(pack.segments):
        for a, n in segs:
            used[j, a:a + n] = True
            ref = F.scaled_dot_product_attention(
                q[j:j + 1, :, a:a + n], k[j:j + 1, :, a:a + n], v[j:j + 1, :, a:a + n],
                is_causal=True, scale=0.125, enable_gqa=True)
            assert (out[j:j + 1, :, a:a + n] - ref).abs().max() < tol
    weight = torch.randn(out.shape, generator=g, device=dev, dtype=dtype) * used[:, None, :, None]
    grads = [torch.autograd.grad((o * weight).sum(), (q, k, v)) for o in (out, seg)]
    for a, b in zip(*grads):
        assert (a.float() - b.float()).abs().max() < tol * 10
