"""DAPO's dynamic sampling as rounds (Yu et al. 2025, section 3.2): a round generates for
a fixed number of prompts, the groups whose rewards are all equal are dropped, and the
step generates again until ``prompts_per_step`` informative groups are kept or
``max_sampling_rounds`` rounds have run.

Every round has the plan's shape (``BatchShape.prompts_generated`` prompts' groups), so
the plan's waves, micro-batches and memory hold in each; what the planner adds is how
many rounds to expect. With a share ``f`` of groups dropped, independently per group,
the informative groups of ``r`` rounds of ``n`` prompts are Binomial(r * n, 1 - f), and a
round ``r + 1`` runs exactly when those are fewer than ``P``:

    E[rounds] = sum_{r = 0}^{R - 1} Pr[Binomial(r * n, 1 - f) < P]    (the r = 0 term is 1)

Example: P = 16 prompts per step, f = 0.45, n = ceil(16 / 0.55) = 30 prompts a round,
R = 4: Pr[Binomial(30, 0.55) < 16] = 0.355 and Pr[Binomial(60, 0.55) < 16] = 2.3e-6, so
E[rounds] = 1.355; the batch is full within the cap but for a chance below 1e-12.
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
