"""Generation lengths: ``gen_len`` is a cap; responses that stop at an end token are
shorter, and a wave decodes until its longest row has stopped.

A :class:`GenLengths` is the distribution of one response's length on ``1..max_len``:
either recorded by a previous run (a histogram), or given by its mean, taken as a
*censored geometric*: the response stops after each token with one fixed probability
``q`` and is cut at the cap, so ``p(x) = q (1 - q)^(x - 1)`` below the cap and the cap
holds every longer response, ``(1 - q)^(max_len - 1)``. This is how sampling with a stop
token and a cap produces lengths: the responses that never stop pile up at the cap,
and a wave that holds one of them decodes to the cap. (The maximum-entropy
distribution with the same mean, ``p(x) ~ exp(-lam x)`` renormalised on
``1..max_len``, has no such mass: at tiny-reason's mean of 103 tokens and cap of 240 it
puts 0.25 % of responses at the cap, where its runs put 11-13 % and the censored
geometric 13 %: benchmarks/async/README.md.) :func:`expected_wave_tokens` prices a
wave's straggler tail: the expected number of tokens a wave of ``b`` rows decodes, i.e.
its longest row's length rounded up to the next stop check (the runtime checks every
``STOP_CHECK_EVERY`` tokens whether all rows have stopped), at most ``max_len``;
:func:`expected_call_tokens` the call's, whose data-parallel ranks wait for the slowest.
"""
from __future__ import annotations

import functools
import math
from statistics import NormalDist
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from planner.graph.dataflow import MFC

#: A generation wave checks every this many tokens whether all its rows have stopped
#: (the check reads a device value on the host, a CUDA synchronisation, so not every
#: token); a wave whose rows all stopped decodes on, masked, until the next check.
STOP_CHECK_EVERY = 8


class GenLengths(BaseModel):
    """Distribution of one response's generated length (tokens, stop token included)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_len: int = Field(gt=0, description="The cap (gen_len).")
    mean: float | None = Field(None, gt=0, description="Mean length (a censored "
                               "geometric on 1..max_len: a fixed stop probability per "
                               "token, responses past the cap cut at it).")
    histogram: tuple[tuple[int, float], ...] = Field(
        (), description="(length, weight) pairs recorded by a run; used instead of mean.")

    @model_validator(mode="after")
    def _check(self) -> "GenLengths":
        if self.mean is None and not self.histogram:
            raise ValueError("give a mean or a histogram of lengths")
        if self.mean is not None and self.mean > self.max_len:
            raise ValueError(f"mean {self.mean} exceeds max_len {self.max_len}")
        if any(not 1 <= x <= self.max_len or w < 0 for x, w in self.histogram):
            raise ValueError(f"histogram lengths must be in 1..{self.max_len}, weights >= 0")
        if self.histogram and sum(w for _, w in self.histogram) <= 0:
            raise ValueError("the histogram holds no weight")
        return self

    def pmf(self) -> list[float]:
        """``p[x - 1]`` = probability that a response has ``x`` tokens."""
        return list(_pmf(self.max_len, self.mean, self.histogram))

    def expected(self) -> float:
        """The expected length (tokens)."""
        return sum(x * p for x, p in enumerate(_pmf(self.max_len, self.mean, self.histogram), 1))


@functools.lru_cache(maxsize=64)
def _pmf(n: int, mean: float | None, histogram: tuple[tuple[int, float], ...]
         ) -> tuple[float, ...]:
    """:meth:`GenLengths.pmf`, computed once per distribution: the planner asks for it
    for every allocation it prices (a pure function of frozen values, so a cache is
    safe)."""
    if histogram:
        p = [0.0] * n
        for x, w in histogram:
            p[x - 1] += w
        total = sum(p)
        return tuple(v / total for v in p)
    assert mean is not None            # GenLengths holds a mean or a histogram
    return censored_geometric(mean, n)


def censored_geometric(mean: float, n: int) -> tuple[float, ...]:
    """``p[x - 1]`` on ``1..n`` of a response that stops after each token with
    probability ``q`` and is cut at ``n``, with ``q`` such that the mean is ``mean``
    (``E = sum_{x=1..n} P(L >= x) = (1 - (1 - q)^n) / q``, which falls from ``n`` at
    ``q -> 0`` to 1 at ``q = 1``: bisection on ``log q``).

    Example: ``n`` = 16 and ``(1 - q)^8 = 1/2``: half the responses stop within 8
    tokens, ``(1 - q)^15`` = 0.27 run to the cap, and the mean is
    ``(1 - (1 - q)^16) / q = 0.75 / q`` = 9.04."""
    if n == 1 or mean <= 1.0:
        return tuple([1.0] + [0.0] * (n - 1))
    if mean >= n:
        return tuple([0.0] * (n - 1) + [1.0])

    def e(q: float) -> float:
        return -math.expm1(n * math.log1p(-q)) / q if q < 1.0 else 1.0

    lo, hi = -60.0, 0.0                      # log q; e() falls as q grows
    for _ in range(200):
        mid = (lo + hi) / 2
        if e(math.exp(mid)) > mean:
            lo = mid
        else:
            hi = mid
    q = math.exp((lo + hi) / 2)
    stay = math.log1p(-q) if q < 1.0 else -math.inf
    return tuple([q * math.exp(stay * (x - 1)) for x in range(1, n)]
                 + [math.exp(stay * (n - 1))])


def wave_token_moments(mfc: "MFC", rows: float) -> tuple[float, float]:
    """Mean and variance of the tokens a wave of ``rows`` sequences of ``mfc`` decodes:
    ``gen_len`` (variance 0) without a length distribution; else those of
    ``min(gen_len, c ceil(L_max / c))``, ``L_max`` the longest of ``rows`` independent
    lengths and ``c = STOP_CHECK_EVERY``."""
    if mfc.lengths is None:
        return float(mfc.gen_len), 0.0
    return longest_moments(mfc.lengths, mfc.gen_len, rows, STOP_CHECK_EVERY)


def longest_moments(lengths: GenLengths, cap: int, rows: float, every: int = 1
                    ) -> tuple[float, float]:
    """Mean and variance of ``min(cap, every ceil(L_max / every))``, ``L_max`` the
    longest of ``rows`` independent lengths (``every`` = 1: the longest itself, the
    length a batch of generated sequences is padded to).

    Example: lengths always 3, cap 20: (3, 0) with every 1, (8, 0) with every 8."""
    return _longest_moments(lengths, cap, float(rows), every)


@functools.lru_cache(maxsize=256)
def _longest_moments(lengths: GenLengths, cap: int, rows: float, every: int
                     ) -> tuple[float, float]:
    """:func:`longest_moments`, once per distribution and batch: the planner prices
    every call that reads a rollout at its padded length, for every layout it tries
    (a pure function of frozen values, so a cache is safe)."""
    p = lengths.pmf()            # on 1..max_len; a length past the cap stops at the cap
    b = max(1.0, rows)
    total, square, cdf, prev = 0.0, 0.0, 0.0, 0.0
    for x in range(1, len(p) + 1):
        cdf = min(1.0, cdf + p[x - 1]) if x < len(p) else 1.0
        now = cdf ** b
        tokens = cap if x >= cap else min(cap, every * math.ceil(x / every))
        total += (now - prev) * tokens
        square += (now - prev) * tokens * tokens
        prev = now
    return total, max(0.0, square - total * total)


def expected_wave_tokens(mfc: "MFC", rows: float) -> float:
    """Expected tokens a wave of ``rows`` sequences of ``mfc`` decodes (its longest
    row's length rounded up to the next stop check, at most ``gen_len``; ``gen_len``
    without a length distribution).

    Example: lengths always 3 of a cap of 20 -> the wave stops at the first check, 8.
    """
    return wave_token_moments(mfc, rows)[0]


def expected_max_std_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals], by Blom's approximation
    ``Phi^-1((n - 0.375) / (n + 0.25))`` (exact 0 for one; 0.589 for two, exactly
    0.564)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def expected_call_tokens(mfc: "MFC", rows: float, groups: int, dp: int) -> float:
    """Expected tokens per group of waves that a generate call of ``mfc`` lasts: each of
    its ``dp`` data-parallel ranks decodes ``groups`` groups of waves of ``rows``
    sequences in turn, and the call ends when its slowest rank does (the ranks gather
    their outputs). One group: the longest of ``rows x dp`` sequences (exact). Several:
    the slowest of ``dp`` sums of ``groups`` independent wave lengths, by the normal
    approximation of the sums: per group ``mean + sd x E[max of dp normals] /
    sqrt(groups)``.

    Example: lengths always 3 (cap 20): 8 tokens whatever the ranks, no spread."""
    if mfc.lengths is None:
        return float(mfc.gen_len)
    if groups <= 1:
        return expected_wave_tokens(mfc, rows * dp)
    mean, var = wave_token_moments(mfc, rows)
    return mean + math.sqrt(var / groups) * expected_max_std_normal(dp)
