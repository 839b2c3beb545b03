"""Generation that refills its slots (:mod:`realign.runtime.engines.refill`), as the
planner prices it: the expected number of iterations a slot group runs, and of the
iterations that admit prompts (each a prefill forward).

A group of ``slots`` slots generates ``rows`` sequences: each slot takes the next
waiting prompt as soon as it is free. A sequence of length ``L`` admitted at iteration
``a`` frees its slot at ``a + n`` when it reaches the cap ``n``, else at the first stop
check (every ``STOP_CHECK_EVERY`` iterations of the group) at or after ``a + L``.
The group ends when its last slot frees; a generate call when the slowest of its
``dp`` ranks does.

Where waves have a closed form (:mod:`planner.graph.lengths`), the refilling queue has
none: the expected end of a queue served by parallel slots with long-tailed service
times is what the runtime will do, so it is simulated, over lengths drawn from the
call's length distribution (a fixed seed: the same plan every time), ``TRIALS`` times
per rank, vectorised over trials and ranks (a few milliseconds; cached per shape).
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import numpy as np

from planner.graph.lengths import STOP_CHECK_EVERY, GenLengths, expected_call_tokens

if TYPE_CHECKING:
    from planner.graph.dataflow import MFC, DataflowGraph

#: simulated calls per data-parallel rank
TRIALS = 64


def refill_shape(mfc: "MFC", slots: int, rows: int, dp: int) -> tuple[float, float]:
    """(expected decode steps, expected admitting iterations) of the slowest of ``dp``
    ranks each generating ``rows`` sequences of ``mfc`` in one group of ``slots``
    slots. An iteration that admits prompts runs their prefill; every iteration but
    the first also runs a decode step of the slots already decoding. Without a length
    distribution every sequence runs to ``gen_len``: ``ceil(rows / slots)`` rounds of
    one prefill and ``gen_len - 1`` steps, as waves of ``slots`` rows.

    Example: no distribution, gen_len 10, 5 rows in 2 slots: 3 rounds -> (27, 3)."""
    n = mfc.gen_len
    if mfc.lengths is None or rows <= 0:
        rounds = math.ceil(max(rows, 0) / max(slots, 1))
        return float(rounds * max(n - 1, 0)), float(rounds)
    if rows <= slots:           # one round: the longest of the rows (the waves' form)
        return max(expected_call_tokens(mfc, rows, 1, dp) - 1.0, 0.0), 1.0
    iterations, admits = _simulate(mfc.lengths, n, max(1, slots), rows, dp)
    return max(iterations - 1.0, 0.0), admits


def release_time(start: np.ndarray, length: np.ndarray, cap: int,
                 every: int = STOP_CHECK_EVERY) -> np.ndarray:
    """The iteration at which a sequence of ``length`` tokens admitted at ``start``
    frees its slot: the first multiple of ``every`` at or after ``start + length``
    (the stop check that sees its stop token), or ``start + cap`` if that comes first
    (its last token).

    Example: start 3, length 4, cap 20, every 8 -> 8; length 20 -> 23; start 1,
    length 5, cap 6 -> 7 (the check at 8 comes after the cap)."""
    stop = np.ceil((start + length) / every) * every
    freed: np.ndarray = np.minimum(np.where(length >= cap, start + cap, stop), start + cap)
    return freed


def slot_schedule(lengths: list[int], slots: int, cap: int) -> list[tuple[int, int]]:
    """(admitted, freed) iteration of each of a queue's sequences of ``lengths`` in
    ``slots`` slots, each into the earliest free slot (the lowest among equals), as the
    runtime admits them.

    Example: lengths [3, 20, 2], 2 slots, cap 20: the first two start at 0; the first
    frees its slot at the check at 8 and the third takes it -> [(0, 8), (0, 20), (8, 16)]."""
    free = [0] * max(1, slots)
    out = []
    for n in lengths:
        j = min(range(len(free)), key=lambda i: (free[i], i))
        start = free[j]
        free[j] = int(release_time(np.array(start), np.array(n), cap))
        out.append((start, free[j]))
    return out


def oldest_age(mfc: "MFC", slots: int) -> float:
    """Expected age (tokens generated) of the oldest of ``slots`` busy slots, the keys
    a refilling step attends over beyond the prompt: in a steady stream a slot's age
    has the renewal density ``P(L > a) / E[L]`` (a long sequence holds its slot long,
    so it is met more often), and the oldest of ``slots`` independent ones has
    ``E = sum_a (1 - F(a)^slots)``. Without a distribution: ``gen_len / 2`` per slot
    (the rows of a round start together, as a wave's).

    Example: every length 4 (cap 8): ages 0..3 equally likely; the oldest of 2:
    1 - (1/4)^2 + 1 - (2/4)^2 + 1 - (3/4)^2 = 2.125."""
    if mfc.lengths is None:
        return mfc.gen_len / 2
    return _oldest_age(mfc.lengths, max(1, slots))


@functools.lru_cache(maxsize=512)
def _oldest_age(lengths: GenLengths, slots: int) -> float:
    """:func:`oldest_age` of a distribution."""
    p = np.asarray(lengths.pmf(), dtype=float)
    survival = 1.0 - np.cumsum(p)                 # P(L > a) for a = 1..n
    ages = np.concatenate([[1.0], survival[:-1]])  # P(L > a) for a = 0..n-1
    cdf = np.cumsum(ages) / ages.sum()
    return float((1.0 - cdf[:-1] ** slots).sum())


@functools.lru_cache(maxsize=512)
def _simulate(lengths: GenLengths, cap: int, slots: int, rows: int, dp: int
              ) -> tuple[float, float]:
    """:func:`refill_shape` with a distribution: TRIALS x dp queues, each a row at a
    time into its earliest free slot."""
    p = np.asarray(lengths.pmf(), dtype=float)
    cdf = np.cumsum(p) / p.sum()
    rng = np.random.default_rng(0)
    k = TRIALS * dp
    drawn = np.minimum(np.searchsorted(cdf, rng.random((k, rows)), side="right") + 1, cap)
    free = np.zeros((k, slots))
    admitted = np.zeros((k, rows))
    at = np.arange(k)
    for r in range(rows):
        j = free.argmin(axis=1)
        start = free[at, j]
        admitted[:, r] = start
        free[at, j] = release_time(start, drawn[:, r], cap)
    end = free.max(axis=1).reshape(TRIALS, dp)
    admits = np.sort(admitted, axis=1)
    events = 1 + (np.diff(admits, axis=1) > 0).sum(axis=1)
    slowest = end.argmax(axis=1)
    return (float(end.max(axis=1).mean()),
            float(events.reshape(TRIALS, dp)[np.arange(TRIALS), slowest].mean()))


def refill_graph(graph: "DataflowGraph") -> "DataflowGraph":
    """``graph`` with every generate call refilling its slots (``rollout.refill``)."""
    mfcs = tuple(m.model_copy(update={"refill": True}) if m.kind == "generate" else m
                 for m in graph.mfcs)
    return graph.model_copy(update={"mfcs": mfcs})
