"""Packed scoring and training: the rows of a call are laid end to end in bins of a
fixed number of tokens instead of each being padded to the batch's longest, with
attention confined to each row (:mod:`realign.runtime.engines.packed_attention`).

Two pure pieces live here, shared by the runtime and the cost model so the planner
prices what runs:

- the bin packing itself, first-fit decreasing (:func:`first_fit_decreasing`), and the
  smallest block-rounded budget that packs a set of rows into a given number of bins
  (:func:`budget_for_bins`);
- the expected shape of a packed call (:func:`packed_shape`): tokens per micro-batch and
  the mean attention context per token, from the rows' length distribution
  (:func:`planner.graph.padding.row_length_pmf`).

How the runtime packs (:mod:`realign.data.packing`):

- **inference** (reference, reward, critic scoring): outputs are per row, so each
  data-parallel rank first-fit-decreasing packs its rows into bins of at most the
  plan's token budget (``MFCAllocation.token_budget``, chosen by the search among
  :func:`budget_options` and priced by :func:`budget_shape`), as many bins as that
  needs. A plan without a budget (fixed ``train.micro_batches``, a hand-made plan)
  packs into at most the plan's micro-batch count of bins, of the smallest budget (a
  multiple of :data:`PACK_BLOCK`) that fits: a bin holds about
  ``rows x mean length / m`` tokens.
- **training**: with the plan's token budget, each data-parallel rank packs one
  optimizer step's rows first-fit decreasing into bins of at most the budget, whole
  groups of ``group_size`` rows at a time (:func:`group_bins`: preference pairs stay
  together), one micro-batch per bin, as many as that takes; without one (fixed
  ``train.micro_batches``, a hand-made plan) the plan's equal rows per micro-batch,
  one bin each. Every bin of a step is as wide as its fullest (block-rounded: one
  static shape, as pipeline stages need). Each micro-batch's loss is weighted by its
  share of the mini-batch's normaliser (its rows or tokens:
  :class:`realign.algorithms.common.TrainLoss`), so the step's gradient is that of the
  mean over the whole mini-batch whatever the bins hold.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

from planner.graph.lengths import expected_max_std_normal
from planner.graph.padding import row_length_pmf

if TYPE_CHECKING:
    from planner.graph.dataflow import MFC, DataflowGraph

#: a bin's token count is a multiple of this (16 fp32 keys = one AVX-512 vector: torch's
#: CPU attention kernels take a slow path on other key lengths; on GPU a tile multiple)
PACK_BLOCK = 16


def round_block(n: int | float, block: int = PACK_BLOCK) -> int:
    """``n`` rounded up to a multiple of ``block`` (at least one block).

    Example: 17 -> 32; 16 -> 16; 0 -> 16."""
    return max(1, math.ceil(n / block)) * block


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices packed into bins of at most ``budget`` tokens: rows longest first
    (ties by index), each into the first bin with room, a new bin when none has.
    Bins are in order of opening, rows within a bin in order of placement.

    Example: lengths [3, 5, 2, 4], budget 7: 5 opens bin 0, 4 opens bin 1 (5 + 4 > 7),
    3 joins bin 1, 2 joins bin 0 -> [[1, 2], [3, 0]]."""
    if any(n > budget for n in lengths):
        raise ValueError(f"a row of {max(lengths)} tokens exceeds the bin of {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for j, free in enumerate(room):
            if lengths[i] <= free:
                bins[j].append(i)
                room[j] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def budget_for_bins(lengths: Sequence[int], bins: int, block: int = PACK_BLOCK) -> int:
    """The smallest multiple of ``block`` at which :func:`first_fit_decreasing` packs
    ``lengths`` into at most ``bins`` bins: from the even share ``sum / bins`` (and the
    longest row) up, a block at a time (first-fit decreasing needs at most 11/9 of the
    optimum plus one bin, so the walk is short).

    Example: [5, 5, 5, 1], 2 bins, block 4 -> 8 is the even share but 5 + 5 > 8 forces a
    third bin; 12 packs [5, 5, 1] and [5]: 12."""
    assert bins >= 1 and lengths
    budget = round_block(max(sum(lengths) / bins, max(lengths)), block)
    while len(first_fit_decreasing(lengths, budget)) > bins:
        budget += block
    return budget


def group_bins(lengths: Sequence[int], group: int, budget: int) -> list[list[int]]:
    """Row indices of a training micro-batch per bin: the rows in ``group``s of
    consecutive rows (a preference pair: 2), whole groups packed first-fit decreasing
    by their token sums into bins of at most ``budget`` tokens; each bin's rows in
    index order (a pair stays chosen, rejected).

    Example: lengths [3, 5, 2, 4], budget 7, group 1 -> [[1, 2], [0, 3]]; group 2 (sums
    8 and 6) needs a budget of 8 at least: 14 -> [[0, 1, 2, 3]], 8 -> [[0, 1], [2, 3]]."""
    if len(lengths) % group:
        raise ValueError(f"{len(lengths)} rows do not split into groups of {group}")
    sums = [sum(lengths[i:i + group]) for i in range(0, len(lengths), group)]
    return [sorted(r for u in b for r in range(u * group, (u + 1) * group))
            for b in first_fit_decreasing(sums, budget)]


def row_moments(mfc: "MFC") -> tuple[float, float, float]:
    """Mean, variance and mean square of one row's length (``prompt + response``).

    Example: prompts always 5 (cap 5), gen_len 3, no distributions: (8, 0, 64)."""
    p = row_length_pmf(mfc)
    x = np.arange(len(p), dtype=float)
    mean = float((p * x).sum())
    sq = float((p * x * x).sum())
    return mean, max(sq - mean * mean, 0.0), sq


def packed_shape(mfc: "MFC", rows: float, micro_batches: int, dp: int
                 ) -> tuple[float, float]:
    """(expected tokens of one packed micro-batch, mean attention context per token) of
    a call of ``mfc`` whose data-parallel ranks each run ``micro_batches`` micro-batches
    of ``rows`` rows (:mod:`module docs <planner.graph.packing>` for how each kind packs).

    Inference: each rank's rows share its bins evenly: ``rows x mean`` plus half a block
    of rounding. Training: the longest of the call's ``micro_batches x dp`` micro-batch
    sums, by the normal approximation of a sum of ``rows`` lengths: ``rows x mean +
    sd x sqrt(rows) x E[max of n normals]``, plus half a block, at most ``rows`` rows at
    the caps. The attention context of a token of a row of length L averages
    ``(L + 1) / 2``, so per token over rows ``E[L (L + 1)] / (2 E[L])``.

    Example: rows always 8 tokens, 3 rows per micro-batch: 24 + 8 = 32 tokens (one
    block-rounded bin of 24), context 4.5."""
    mean, var, sq = row_moments(mfc)
    tokens = rows * mean
    if mfc.kind == "train":
        tokens += math.sqrt(var * rows) * expected_max_std_normal(micro_batches * dp)
    tokens = min(tokens + PACK_BLOCK / 2, round_block(rows * mfc.seq_len))
    return tokens, (sq + mean) / (2 * mean)


def budget_shape(mfc: "MFC", rows: float, budget: int) -> tuple[int, float, float]:
    """(expected bins, tokens of one packed micro-batch, mean attention context per
    token) of a packed scoring call of ``mfc`` whose data-parallel rank packs ``rows``
    rows first-fit decreasing into bins of at most ``budget`` tokens.

    A training call's ``rows`` are one optimizer step's; its bins hold whole groups
    of ``mfc.group_size`` rows (preference pairs). Rows all of one length ``L`` (no
    length distribution): ``floor(budget / L)`` rows a bin (whole groups), exactly, as
    wide as they are (block-rounded). Otherwise the rank's rows hold
    ``E = rows x mean`` tokens: one bin when ``E <= budget``, of ``E`` plus half a block
    (the runtime's packs are as wide as the fullest bin, block-rounded); beyond,
    first-fit decreasing leaves each bin short of the budget by what no remaining row
    fills, estimated as half a mean row: ``ceil(E / (budget - mean / 2))`` bins (at
    least 2, at most one per row), each as wide as the budget (the fullest bin reaches
    it but for a block). The context is that of :func:`packed_shape`.

    Example: rows always 8 tokens, 32 rows: budget 256 -> one bin of 256 tokens;
    budget 60 -> 7 rows a bin, 5 bins of 64 (56 block-rounded); context 4.5 either way."""
    mean, var, sq = row_moments(mfc)
    ctx = (sq + mean) / (2 * mean)
    if var == 0:
        g = mfc.group_size
        per = min(max(1, int(budget // (mean * g))) * g, max(g, math.ceil(rows)))
        return math.ceil(rows / per), float(round_block(per * mean)), ctx
    total = rows * mean
    if total <= budget:
        return 1, min(total + PACK_BLOCK / 2, float(budget)), ctx
    bins = math.ceil(total / max(budget - mean / 2, 1.0))
    return max(2, min(bins, math.ceil(rows))), float(budget), ctx


def budget_options(mfc: "MFC", rows: int, max_bins: int) -> list[int]:
    """Token budgets to price for a packed scoring or training call of ``mfc`` with
    ``rows`` rows per data-parallel rank (a training call: per optimizer step): from the
    smallest that holds any row (``round_block(seq_len)``; a group of ``group_size``
    rows, for pairs)
    to the rank's whole share at the caps (``round_block(rows x seq_len)``: one bin
    whatever the lengths), with :data:`PACK_BLOCK` times the powers of two between, and
    the budgets that pack the rows in about ``m`` bins for ``m`` a power of two or
    ``rows`` (``ceil(rows / m)`` mean rows, plus half a mean row of first-fit waste
    when lengths vary); only those whose expected bins (:func:`budget_shape`) are at
    most ``max_bins`` (the largest always is: one bin).

    Example: seq_len 100, 8 rows of always 100 tokens, up to 8 bins: 112 (8 bins), 128
    (8), 208 (4 bins of 2 rows), 256 (4), 400 (2 of 4), 512 (2) and 800 (one) ->
    [112, 128, 208, 256, 400, 512, 800]; up to 4 bins: [208, 256, 400, 512, 800]."""
    lo, hi = round_block(mfc.group_size * mfc.seq_len), round_block(rows * mfc.seq_len)
    mean, var, _ = row_moments(mfc)
    waste = mean / 2 if var > 0 else 0.0
    fits = {round_block(math.ceil(rows / m) * mean + waste)
            for m in [1 << k for k in range(rows.bit_length())] + [rows]}
    out = sorted({lo, hi} | {b for b in fits if lo < b < hi}
                 | {PACK_BLOCK << k for k in range(hi.bit_length()) if lo < PACK_BLOCK << k < hi})
    return [b for b in out if b == hi or budget_shape(mfc, rows, b)[0] <= max_bins]


def packed_graph(graph: "DataflowGraph") -> "DataflowGraph":
    """``graph`` with every scoring and training call packed (``train.packing``)."""
    mfcs = tuple(m.model_copy(update={"packed": True}) if m.kind != "generate" else m
                 for m in graph.mfcs)
    return graph.model_copy(update={"mfcs": mfcs})
