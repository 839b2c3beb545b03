"""The lengths a call's batch is padded to, which its time is priced at.

``prompt_len`` and ``gen_len`` are caps. The runtime pads each batch to its longest
row only: a generation wave prefills its prompts right-padded to the wave's longest
prompt (:mod:`realign.runtime.engines.generate`), and the rollout a call scores or
trains is one batch of rows ``prompt + response`` padded to the longest
(:func:`realign.worker.records.sequences_from_generation`). With the distributions of
the prompts' lengths (``MFC.prompt_lengths``, read from the training data) and of the
responses' (``MFC.lengths``), the expected padded length is that of the longest of the
batch's rows; without them, the cap.

Rows are taken as independent, also the samples of one prompt (which share their
prompt's length): with several samples per prompt the longest prompt of a batch is
slightly overstated. Memory is still priced at the caps: one step may reach them.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from planner.graph.lengths import GenLengths, longest_moments

if TYPE_CHECKING:
    from planner.graph.dataflow import MFC


def longest_prompt(mfc: "MFC", rows: float) -> float:
    """Expected length of the longest of ``rows`` prompts of ``mfc`` (a wave's
    prefill is padded to it): ``prompt_len`` without a prompt-length distribution.

    Example: prompts of 5 tokens always, cap 8: 5."""
    if mfc.prompt_lengths is None:
        return float(mfc.prompt_len)
    return longest_moments(mfc.prompt_lengths, mfc.prompt_len, rows)[0]


def padded_moments(mfc: "MFC") -> tuple[float, float]:
    """Mean and variance, over steps, of the length of the rows a call that scores or
    trains a rollout runs on: the longest ``prompt + response`` of its ``n_seqs``
    rows (prompt and response lengths independent); ``(prompt_len + gen_len, 0)``
    for a generate call, or one with neither distribution.

    Example: prompts of 5 always (cap 8), responses of 3 always (cap 20): (8, 0)."""
    if mfc.kind == "generate":
        return float(mfc.seq_len), 0.0
    return rollout_moments(mfc)


def rollout_moments(mfc: "MFC") -> tuple[float, float]:
    """Mean and variance of the length the ``n_seqs`` rows of the rollout whose length
    distributions ``mfc`` carries (a generate call's own, or a call's that reads it)
    are padded to; ``(prompt_len + gen_len, 0)`` with neither distribution."""
    if mfc.lengths is None and mfc.prompt_lengths is None:
        return float(mfc.seq_len), 0.0
    return _padded_moments(mfc.prompt_lengths, mfc.prompt_len, mfc.lengths, mfc.gen_len,
                           float(mfc.n_seqs))


def padded_len(mfc: "MFC") -> float:
    """Expected tokens per row of a call that scores or trains a rollout (its
    :func:`padded_moments`' mean).

    Example: prompt 8 (no distribution), responses of 3 always (cap 20): 11, not 28."""
    return padded_moments(mfc)[0]


def row_length_pmf(mfc: "MFC") -> np.ndarray:
    """The pmf of one row's length ``prompt + response`` of the rollout ``mfc`` scores
    or trains (prompt and response independent), indexed from 0 on
    ``0..prompt_len + gen_len``; a point at the caps without distributions.

    Example: prompts of 5 always (cap 8), no response distribution, gen_len 3: all
    weight at 8."""
    return np.convolve(_on_zero(mfc.prompt_lengths, mfc.prompt_len),
                       _on_zero(mfc.lengths, mfc.gen_len))


def _point(n: int) -> np.ndarray:
    """The pmf of a length that is always ``n``, on ``0..n``."""
    p = np.zeros(n + 1)
    p[n] = 1.0
    return p


def _on_zero(lengths: GenLengths | None, cap: int) -> np.ndarray:
    """The pmf of ``lengths`` (``cap`` always when None) indexed from length 0, a length
    past ``cap`` cut at it."""
    if lengths is None:
        return _point(cap)
    p = np.concatenate(([0.0], np.asarray(lengths.pmf())))
    if len(p) > cap + 1:
        p = np.concatenate((p[:cap], [p[cap:].sum()]))
    return p


@functools.lru_cache(maxsize=256)
def _padded_moments(prompts: GenLengths | None, prompt_cap: int, responses: GenLengths | None,
                    gen_cap: int, rows: float) -> tuple[float, float]:
    """:func:`padded_moments`, once per distribution pair and batch (a pure function of
    frozen values, so a cache is safe; the planner prices every layout it tries). The
    row's length is the sum of two independent lengths: its pmf is their convolution
    (numpy's), on ``1..prompt_cap + gen_cap``."""
    total = np.convolve(_on_zero(prompts, prompt_cap), _on_zero(responses, gen_cap))
    cap = prompt_cap + gen_cap
    hist = tuple((x, float(w)) for x, w in enumerate(total) if x >= 1 and w > 0)
    return longest_moments(GenLengths(max_len=cap, histogram=hist), cap, rows)
