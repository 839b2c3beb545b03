"""Causal attention within each row of a packed micro-batch
(:class:`realign.data.packing.Pack`): a token attends to the earlier tokens of its own
row only, never across rows of a bin, and no ``[bins, heads, width, width]`` mask is
built.

Two kernels behind one call, picked by the device (:func:`kernel_for`):

- ``flex`` (CUDA): torch's FlexAttention, compiled, with a block mask from each token's
  row within its bin (``create_block_mask``). One kernel per layer for the whole pack;
  tiles that lie across two rows are skipped, so the work is each row's own causal
  triangle plus the tiles on row boundaries. Chosen over flash-attn's varlen (not a
  dependency, no CPU build) and Transformer-Engine's THD format (CUDA only, and the
  plain forward does not use TE's layers); FlexAttention ships with torch, does grouped
  query attention itself and has a backward.
- ``segments`` (CPU): FlexAttention has no backward on CPU in torch 2.13 ("does not
  support backward on CPU"), and its eager path computes the full scores. So each
  row's span of the bin runs through ``scaled_dot_product_attention`` with
  ``is_causal`` (torch's fused CPU kernel, no mask): the same per-row work, a Python
  loop over rows. Tokens past a bin's last row attend to nothing and give zeros.

Both are tested equal to each other and to the padded forward (tests/runtime).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from realign.data.packing import Kernel, Pack


def kernel_for(device_kind: str) -> Kernel:
    """``flex`` on CUDA, ``segments`` elsewhere (module docs)."""
    return "flex" if device_kind == "cuda" else "segments"


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: Pack,
                     scale: float, gqa: bool) -> torch.Tensor:
    """q [bins, heads, width, d], k and v [bins, kv_heads, width, d] -> [bins, heads,
    width, d], each token attending causally within its own row."""
    if pack.kernel == "flex":
        return _flex(q, k, v, pack, scale, gqa)
    return _segments(q, k, v, pack, scale, gqa)


def _segments(q, k, v, pack: Pack, scale: float, gqa: bool) -> torch.Tensor:
    width = q.shape[2]
    bins = []
    for j, segs in enumerate(pack.segments):
        parts = [F.scaled_dot_product_attention(
            q[j:j + 1, :, a:a + n], k[j:j + 1, :, a:a + n], v[j:j + 1, :, a:a + n],
            is_causal=True, scale=scale, enable_gqa=gqa) for a, n in segs]
        used = segs[-1][0] + segs[-1][1] if segs else 0
        if used < width:
            parts.append(q.new_zeros(1, q.shape[1], width - used, q.shape[3]))
        bins.append(torch.cat(parts, dim=2))
    return torch.cat(bins) if len(bins) > 1 else bins[0]


def _flex(q, k, v, pack: Pack, scale: float, gqa: bool) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    mask = pack.cache.get("block_mask")
    if mask is None:
        mask = pack.cache["block_mask"] = block_mask(pack.doc)
    fn = _compiled_flex() if q.is_cuda else flex_attention
    return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)


def block_mask(doc: torch.Tensor):
    """FlexAttention's block mask of a pack: query q sees key k of the same bin when both
    belong to the same row (``doc``, -1 past the last row: those see each other, so no
    query row is empty) and ``k <= q``."""
    from torch.nn.attention.flex_attention import create_block_mask

    bins, width = doc.shape

    def within_row(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)
    return create_block_mask(within_row, B=bins, H=None, Q_LEN=width, KV_LEN=width,
                             device=doc.device)


@functools.cache
def _compiled_flex():
    """FlexAttention compiled once per process (its fused kernel; uncompiled it computes
    the full score matrix)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
