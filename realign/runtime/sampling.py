"""Sampling parameters and the choice of the next token from full-vocabulary logits.

Sampling is seeded per sequence (``seed + global index of the sequence``), so a
sampled output does not depend on the layout (TP/PP/DP) that produced it.
"""
from __future__ import annotations

import torch

from realign.runtime.settings import SamplingParams


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to float logits [b, V]; removed tokens get
    ``-inf``."""
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


def choose_tokens(logits: torch.Tensor, p: SamplingParams, generators: list[torch.Generator],
                  active: torch.Tensor) -> torch.Tensor:
    """Next token per row of float logits [b, V] (padding vocabulary already masked).

    Only ``active`` rows (those generating at this step) draw from their generator, so
    a sequence's samples depend on its seed alone, not on the batch around it."""
    choice = logits.argmax(dim=-1)
    if p.greedy:
        return choice
    probs = filter_logits(logits, p).softmax(dim=-1)
    for i in active.nonzero().flatten().tolist():
        choice[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return choice


def make_generators(p: SamplingParams, first_index: int, n: int) -> list[torch.Generator]:
    """One generator per sequence ``first_index .. first_index + n - 1``."""
    return [torch.Generator().manual_seed(p.seed + first_index + i) for i in range(n)]
