"""Sampling parameters and the choice of the next token from full-vocabulary logits.

Sampling is Gumbel-max with counter-based noise: the noise of token ``v`` for the
``t``-th generated position of sequence ``i`` is a hash of ``(seed, i, t, v)``, where
``i`` is the sequence's global index in the call. A sampled output therefore does not
depend on the layout (TP/PP/DP) that produced it nor on the batch around it, and the
whole batch is drawn with a few vectorised integer operations (no per-row generator).
``argmax(logits + Gumbel noise)`` is an exact draw from ``softmax(logits)``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from realign.runtime.settings import SamplingParams

_M32 = 0xFFFFFFFF


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to float logits [b, V]; removed tokens get
    ``-inf``."""
    if p.temperature != 1.0:
        logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xorshift-multiply, constants of C. Wellons' "lowbias32")
    on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _hash32_int(x: int) -> int:
    """:func:`hash32` of one Python int."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seed: int, seq_ids: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """float64 uniforms in (0, 1), [b, vocab]: a pure function of (seed, sequence id,
    generated position, token id)."""
    return uniform_noise_block(seed, seq_ids, range(position, position + 1), vocab)[0]


def _step_hashes(seed: int, positions, device) -> torch.Tensor:
    """The hash of ``(seed, t)`` for each generated position ``t`` of ``positions``."""
    base = _hash32_int(seed) ^ _hash32_int((seed >> 32) ^ 0x5BD1E995)
    return torch.tensor([_hash32_int(base ^ _hash32_int(t + 0x9E3779B9)) for t in positions],
                        dtype=torch.long, device=device)


def position_hashes(seed: int, n: int, device=None) -> torch.Tensor:
    """[n] the per-position part of the noise of positions ``0..n-1`` (made once per
    call, then indexed: :func:`gumbel_noise_hashed`)."""
    return _step_hashes(seed, range(n), device)


def _uniform_of(row: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 uniforms [..., vocab] of each ``(seed, sequence, position)`` hash in ``row``."""
    tok = hash32(torch.arange(vocab, device=row.device) ^ 0x68E31DA4)
    bits = hash32(row.unsqueeze(-1) ^ tok)
    return (bits.double() + 0.5) / 2.0 ** 32


def uniform_noise_block(seed: int, seq_ids: torch.Tensor, positions: range, vocab: int
                        ) -> torch.Tensor:
    """:func:`uniform_noise` of several consecutive positions at once, [len(positions),
    b, vocab] (fewer, larger tensor operations than one call per position)."""
    steps = _step_hashes(seed, positions, seq_ids.device)
    return _uniform_of(hash32(hash32(seq_ids.long() & _M32).unsqueeze(0) ^ steps.unsqueeze(1)),
                       vocab)


def gumbel_noise_rows(seed: int, seq_ids: torch.Tensor, positions: Sequence[int], vocab: int
                      ) -> torch.Tensor:
    """The Gumbel noise [b, vocab] of each row ``i`` at its own generated position
    ``positions[i]`` (generation that refills its slots: rows at different positions
    share a step); row ``i`` equals :func:`gumbel_noise` of ``seq_ids[i]`` at that
    position."""
    return gumbel_noise_hashed(_step_hashes(seed, positions, seq_ids.device), seq_ids, vocab)


def gumbel_noise_hashed(steps: torch.Tensor, seq_ids: torch.Tensor, vocab: int
                        ) -> torch.Tensor:
    """:func:`gumbel_noise_rows` from each row's :func:`position_hashes` entry ``steps``
    [b] (no per-row host work)."""
    u = _uniform_of(hash32(hash32(seq_ids.long() & _M32) ^ steps), vocab)
    return -torch.log(-torch.log(u))


def gumbel_noise(seed: int, seq_ids: torch.Tensor, positions: range, vocab: int
                 ) -> torch.Tensor:
    """The Gumbel noise ``-log(-log(u))`` :func:`choose_tokens` adds, [len(positions),
    b, vocab], for callers that draw several positions from one computation."""
    return -torch.log(-torch.log(uniform_noise_block(seed, seq_ids, positions, vocab)))


def choose_tokens(logits: torch.Tensor, p: SamplingParams, seq_ids: torch.Tensor,
                  position: int, gumbel: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row of float logits [b, V] (padding vocabulary already masked);
    ``seq_ids`` [b] global sequence indices, ``position`` the index of the token being
    generated; ``gumbel`` [b, V] that position's :func:`gumbel_noise` if already made."""
    if p.greedy:
        return logits.argmax(dim=-1)
    if gumbel is None:
        gumbel = gumbel_noise(p.seed, seq_ids, range(position, position + 1),
                              logits.shape[-1])[0]
    return (filter_logits(logits, p).double() + gumbel).argmax(dim=-1)
