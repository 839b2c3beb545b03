"""DAPO's dynamic sampling as rounds (Yu et al. 2025, section 3.2): a round generates for
some prompts, the groups whose rewards are all equal are dropped, and the step generates
again until ``prompts_per_step`` informative groups are kept or ``max_sampling_rounds``
rounds have run.

The first round has the plan's shape (``BatchShape.prompts_generated`` prompts'
groups). A later round generates for as many prompts as the missing groups need at the
drop rate seen (:func:`round_size`, at most ``max_round_prompts``); it runs in more waves
and micro-batches, none larger than the plan's, so the plan's memory holds. What the
planner adds is how much to expect: :func:`sized_rounds` (exact over the distribution of
the groups still missing after each round, groups dropped independently at a share
``f``) gives the expected rounds and prompts, and the rollout's calls are priced at the
expected prompts over the first round's.

Rounds of one fixed size ``n`` (the first round's) are the special case the paper's
loop reduces to when every round re-draws ``n`` prompts: the informative groups of ``r``
rounds are Binomial(r * n, 1 - f), and a round ``r + 1`` runs exactly when those are
fewer than ``P``:

    E[rounds] = sum_{r = 0}^{R - 1} Pr[Binomial(r * n, 1 - f) < P]    (the r = 0 term is 1)

Example: P = 16 prompts per step, f = 0.45, n = ceil(16 / 0.55) = 30 prompts a round,
R = 4: Pr[Binomial(30, 0.55) < 16] = 0.355 and Pr[Binomial(60, 0.55) < 16] = 2.3e-6, so
E[rounds] = 1.355. At f = 0.95 the same four rounds fill a batch with a chance of 3e-4
(:func:`full_batch_chance`); rounds sized from the rate (cap 240) fill it with 0.9996,
generating for 396 prompts on average.
"""
from __future__ import annotations

import math

import numpy as np

#: The most sampling rounds a step may take (``algorithm.params.max_sampling_rounds``).
MAX_SAMPLING_ROUNDS = 64


def binomial_cdf_below(n: int, p: float, k: int) -> float:
    """Pr[Binomial(n, p) < k], exactly (a log-space sum over the k terms below k).

    Example: n 4, p 0.5, k 2 -> (1 + 4) / 16 = 0.3125."""
    if k <= 0:
        return 0.0
    if k > n:
        return 1.0
    if p >= 1.0:
        return 0.0
    if p <= 0.0:
        return 1.0
    j = np.arange(1, k, dtype=np.float64)
    # log pmf(j) - log pmf(j - 1) = log((n - j + 1) / j) + log(p / (1 - p))
    steps = np.log((n - j + 1) / j) + math.log(p / (1 - p))
    log_pmf = n * math.log1p(-p) + np.concatenate(([0.0], np.cumsum(steps)))
    top = float(log_pmf.max())
    return min(1.0, math.exp(top) * float(np.exp(log_pmf - top).sum()))


def short_after(rounds: int, prompts_per_round: int, wanted: int, dropped_frac: float
                ) -> float:
    """The chance that ``rounds`` rounds of ``prompts_per_round`` prompts keep fewer than
    ``wanted`` informative groups when a share ``dropped_frac`` is dropped."""
    return binomial_cdf_below(rounds * prompts_per_round, 1.0 - dropped_frac, wanted)


def expected_rounds(prompts_per_round: int, wanted: int, dropped_frac: float,
                    max_rounds: int) -> float:
    """The expected sampling rounds of a step (the module's formula), 1 .. ``max_rounds``.

    Example: 30 prompts a round, 16 wanted, a share 0.45 dropped, at most 4 rounds ->
    1.355; nothing dropped -> 1.0; at most 1 round -> 1.0."""
    if not 1 <= max_rounds <= MAX_SAMPLING_ROUNDS:
        raise ValueError(f"max_rounds {max_rounds} outside 1 .. {MAX_SAMPLING_ROUNDS}")
    return 1.0 + sum(short_after(r, prompts_per_round, wanted, dropped_frac)
                     for r in range(1, max_rounds))


def full_batch_chance(prompts_per_round: int, wanted: int, dropped_frac: float,
                      max_rounds: int) -> float:
    """The chance that a step keeps ``wanted`` informative groups within ``max_rounds``."""
    return 1.0 - short_after(max_rounds, prompts_per_round, wanted, dropped_frac)


# ---- rounds sized from the drop rate -------------------------------------------------
# A later round generates for the groups still missing, over-sized by the drop rate
# measured so far (the runtime's :class:`realign.worker.sampling_loop.DropRate`; the
# planner's expectation below assumes the rate it prices): m missing groups at a share f
# dropped need about m / (1 - f) prompts. A fixed round size (the first round's) keeps
# only (1 - f) of its prompts, so at f = 0.95 four rounds of 30 prompts keep about 6 of
# 16 groups where one round of 320 prompts fills the batch; the user's cap
# (``algorithm.params.max_round_prompts``) bounds a round's prompts, and so its time.

#: the default cap on a later round's prompts, in first rounds (``prompts_generated``):
#: 8 lets one round fill a batch up to a drop rate of about 0.9 at the tiny task's
#: shape (16 groups, a first round of 30: 236 prompts keep 16 with the margin) while
#: a round at a rate near 1 (a settled policy, where no round fills) costs at most 8
#: first rounds' time
DEFAULT_ROUND_CAP_FACTOR = 8
#: the largest cap a user may set (``algorithm.params.max_round_prompts``)
MAX_ROUND_PROMPTS = 1_000_000


#: the margin a later round is sized with, in standard deviations of its kept groups:
#: it keeps the missing groups with a chance of about 95 % (one-sided normal quantile)
ROUND_MARGIN_Z = 1.645


def round_size(missing: int, dropped_frac: float, cap: int, quantum: int = 1) -> int:
    """The prompts a later round generates for: the fewest n whose informative groups,
    Binomial(n, 1 - f) at f = ``dropped_frac``, reach ``missing`` with a margin of
    :data:`ROUND_MARGIN_Z` standard deviations, n (1 - f) - z sqrt(n f (1 - f)) >=
    missing (solved for sqrt(n)), rounded up to a multiple of ``quantum`` (so the
    round's rows split over every call's data-parallel ranks), at least one ``quantum``
    and at most ``cap`` (rounded down to a multiple of ``quantum``; a ``cap`` below
    ``quantum`` is refused: no round fits it). A share of 1 (every group so far
    constant) asks for the cap. Without the margin
    (n = missing / (1 - f)) a round falls short about half the time and the step takes
    another round.

    Example: 3 missing at 0.5 dropped, cap 120, quantum 4 -> n = 11.6 -> 12; 13 missing
    at 0.9, cap 120, quantum 2 -> 120 (the cap); 0 missing -> 4 (one quantum)."""
    if (missing < 0 or quantum < 1 or cap < quantum
            or not 0.0 <= dropped_frac <= 1.0):
        raise ValueError(f"round_size({missing}, {dropped_frac}, {cap}, {quantum})")
    top = cap // quantum * quantum
    keep = 1.0 - dropped_frac
    if keep * top <= missing:           # the cap keeps no more than what is missing
        return top
    spread = ROUND_MARGIN_Z * math.sqrt(dropped_frac * keep)
    root = (spread + math.sqrt(spread * spread + 4.0 * keep * missing)) / (2.0 * keep)
    want = math.ceil(root * root - 1e-9)
    return min(top, max(quantum, -(-want // quantum) * quantum))


def _binomial_head(n: int, p: float, m: int, log_fact: np.ndarray) -> np.ndarray:
    """Pr[Binomial(n, p) = j] for j = 0 .. m - 1, then Pr[Binomial(n, p) >= m] (m <= n;
    log space, ``log_fact[x]`` = log x!)."""
    out = np.zeros(m + 1)
    if p <= 0.0 or p >= 1.0:
        out[0 if p <= 0.0 else min(n, m)] = 1.0
        return out
    j = np.arange(min(m, n + 1), dtype=np.float64)
    ji = j.astype(np.int64)
    log = log_fact[n] - log_fact[ji] - log_fact[n - ji] + j * math.log(p) + (
        n - j) * math.log1p(-p)
    head = np.exp(log)
    out[:head.shape[0]] = head
    out[m] = max(0.0, 1.0 - float(head.sum()))
    return out


def sized_rounds(first_prompts: int, wanted: int, dropped_frac: float, max_rounds: int,
                 cap: int, quantum: int = 1) -> tuple[float, float, float]:
    """(expected rounds, expected prompts generated, chance of a full batch) of a step
    whose first round generates for ``first_prompts`` prompts and each later round for
    :func:`round_size` (the missing groups at ``dropped_frac``, at most ``cap``, in
    multiples of ``quantum``: the runtime's :func:`realign.run.program.round_quantum`),
    groups dropped independently at ``dropped_frac``, at most ``max_rounds`` rounds.
    Exact over the distribution of the groups still missing after each round (a round
    that keeps j of m missing leaves m - j; any j >= m fills the batch), in
    O(rounds x wanted^2) after one table of log-factorials.

    Example: 30 prompts first, 16 wanted, 0.45 dropped, 4 rounds, cap 240 -> 1.360
    rounds and 33.3 prompts (a first round short by a few groups is followed by a
    round of a few prompts), full with a chance of 1 - 4e-7; rounds of 30 prompts each
    generate for 30 x 1.355 = 40.7."""
    if not 1 <= max_rounds <= MAX_SAMPLING_ROUNDS:
        raise ValueError(f"max_rounds {max_rounds} outside 1 .. {MAX_SAMPLING_ROUNDS}")
    keep = 1.0 - dropped_frac
    sizes = [round_size(m, dropped_frac, cap, quantum) for m in range(wanted + 1)]
    top = max(first_prompts, max(sizes))
    log_fact = np.concatenate(([0.0], np.cumsum(np.log(np.arange(1, top + 1)))))
    heads: dict[tuple[int, int], np.ndarray] = {}
    missing = np.zeros(wanted + 1)          # Pr[missing = m] before the round
    missing[wanted] = 1.0
    rounds = prompts = 0.0
    for r in range(max_rounds):
        live = float(missing[1:].sum())
        if live <= 0.0:
            break
        rounds += live
        nxt = np.zeros(wanted + 1)
        nxt[0] = missing[0]
        for m in range(1, wanted + 1):
            w = missing[m]
            if w == 0.0:
                continue
            n = first_prompts if r == 0 else sizes[m]
            prompts += w * n
            key = (n, m)
            if key not in heads:
                heads[key] = _binomial_head(n, keep, m, log_fact)
            h = heads[key]
            nxt[1:m + 1] += w * h[:m][::-1]          # j < m kept: m - j still missing
            nxt[0] += w * h[m]
        missing = nxt
    return float(rounds), float(prompts), float(missing[0])
