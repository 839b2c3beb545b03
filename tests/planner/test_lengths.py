"""planner.graph.lengths against hand computation: a wave of ``b`` rows decodes until its
longest row stops, rounded up to the next stop check (every STOP_CHECK_EVERY = 8
tokens), at most ``gen_len``.

With a cap of 16 every wave stops after 8 or 16 tokens, so
``E = 8 P(L_max <= 8) + 16 (1 - P(L_max <= 8))`` and ``P(L_max <= 8) = F(8)^b``. For the
censored geometric (stop after each token with probability ``q = 1 - r``, cut at 16),
``F(8) = 1 - r^8``; with ``r^8 = 1/2`` that is 1/2, and the mean is
``1 + r + .. + r^15 = (1 - r^16) / (1 - r)``.
"""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from planner.graph.dataflow import MFC
from planner.graph.lengths import (
    STOP_CHECK_EVERY,
    GenLengths,
    expected_call_tokens,
    expected_max_std_normal,
    expected_wave_tokens,
    wave_token_moments,
)

pytestmark = pytest.mark.pure


def gen(cap: int, lengths: GenLengths | None = None) -> MFC:
    return MFC(name="actor.generate", role="actor", kind="generate", n_seqs=8, prompt_len=4,
               gen_len=cap, input_keys=("prompts",), output_keys=("seqs",), lengths=lengths)


def fixed(cap: int, length: int) -> GenLengths:
    return GenLengths(max_len=cap, histogram=((length, 1.0),))


def test_stop_check_matches_the_runtime():
    assert STOP_CHECK_EVERY == 8


def test_without_a_distribution_every_wave_runs_to_the_cap():
    assert expected_wave_tokens(gen(20), 1) == 20.0
    assert expected_wave_tokens(gen(20), 64) == 20.0


@pytest.mark.parametrize("length,tokens", [
    (1, 8), (3, 8), (8, 8),       # stops at the first check
    (9, 16), (16, 16),            # the second
    (17, 20), (20, 20),           # the third check (24) is past the cap: the cap
])
def test_fixed_length_rounds_up_to_the_next_stop_check(length, tokens):
    for rows in (1, 16):
        assert expected_wave_tokens(gen(20, fixed(20, length)), rows) == pytest.approx(tokens)


def test_a_mean_is_a_censored_geometric():
    r = 0.5 ** (1 / 8)                                     # r^8 = 1/2
    q = 1 - r
    mean = (1 - r ** 16) / q
    assert mean == pytest.approx(9.0366, abs=1e-4)          # below the cap of 16
    lengths = GenLengths(max_len=16, mean=mean)
    p = lengths.pmf()
    assert len(p) == 16 and sum(p) == pytest.approx(1.0)
    assert p[0] == pytest.approx(q, rel=1e-9)
    for a, b in zip(p[:14], p[1:15]):                     # geometric below the cap: ratio r
        assert b / a == pytest.approx(r, rel=1e-9)
    assert p[15] == pytest.approx(r ** 15, rel=1e-9)       # every longer response: the cap
    m = gen(16, lengths)
    f8 = 1 / 2
    assert expected_wave_tokens(m, 1) == pytest.approx(16 - 8 * f8, rel=1e-9)       # 12
    assert expected_wave_tokens(m, 4) == pytest.approx(16 - 8 * f8 ** 4, rel=1e-9)  # 15.5
    # fewer than one row counts as one
    assert expected_wave_tokens(m, 0.5) == pytest.approx(16 - 8 * f8, rel=1e-9)


def test_the_extremes_of_the_mean():
    assert GenLengths(max_len=5, mean=5.0).pmf() == [0.0] * 4 + [1.0]      # never stops
    assert GenLengths(max_len=5, mean=1.0).pmf() == [1.0] + [0.0] * 4      # stops at once
    assert GenLengths(max_len=5, mean=0.5).pmf() == [1.0] + [0.0] * 4      # at least a token
    assert GenLengths(max_len=1, mean=1.0).pmf() == [1.0]


def test_a_high_mean_piles_up_at_the_cap():
    p = GenLengths(max_len=5, mean=4.5).pmf()
    assert p[:4] == sorted(p[:4], reverse=True) and p[4] == max(p)
    assert sum(x * v for x, v in zip(range(1, 6), p)) == pytest.approx(4.5)


def test_histogram():
    # lengths 3, 12, 20 with weights 1, 1, 2 (normalised: 1/4, 1/4, 1/2), cap 20.
    # Two rows: P(L_max <= 3) = 1/16 -> 8 tokens, P(L_max <= 12) = 1/4 -> 16 tokens
    # (12 rounds up to 16), the rest 3/4 -> the cap, 20.
    lengths = GenLengths(max_len=20, histogram=((3, 1.0), (12, 0.5), (20, 2.0), (12, 0.5)))
    p = lengths.pmf()
    assert (p[2], p[11], p[19]) == (0.25, 0.25, 0.5) and sum(p) == 1.0
    assert expected_wave_tokens(gen(20, lengths), 2) == pytest.approx(
        8 / 16 + 16 * 3 / 16 + 20 * 3 / 4)                     # 18.5
    assert expected_wave_tokens(gen(20, lengths), 1) == pytest.approx(
        8 / 4 + 16 / 4 + 20 / 2)                               # 16


def test_a_callers_changes_to_the_pmf_stay_its_own():
    # the distribution is computed once and kept: each caller gets a copy
    lengths = GenLengths(max_len=20, mean=6.0)
    p = lengths.pmf()
    p[0] = 99.0
    assert lengths.pmf()[0] < 1.0
    assert GenLengths(max_len=20, mean=6.0).pmf() == lengths.pmf()


def test_more_rows_wait_for_a_longer_straggler():
    lengths = GenLengths(max_len=64, mean=10.0)
    t = [expected_wave_tokens(gen(64, lengths), b) for b in (1, 4, 16, 64)]
    assert t == sorted(t) and t[0] > 10.0 and t[-1] < 64.0


def test_the_wave_tokens_spread():
    # the histogram above, two rows: 8 w.p. 1/16, 16 w.p. 3/16, 20 w.p. 3/4
    lengths = GenLengths(max_len=20, histogram=((3, 1.0), (12, 1.0), (20, 2.0)))
    mean, var = wave_token_moments(gen(20, lengths), 2)
    assert mean == pytest.approx(18.5)
    assert var == pytest.approx(64 / 16 + 256 * 3 / 16 + 400 * 3 / 4 - 18.5 ** 2)   # 9.75
    assert wave_token_moments(gen(20), 2) == (20.0, 0.0)


def test_data_parallel_ranks_wait_for_the_slowest():
    """One wave per rank: the call lasts as long as the longest of all the ranks' rows
    (2 ranks of 1 row = one wave of 2 rows: 18.5, not 16). Two waves per rank: each rank
    sums two waves (mean 2 x 16, variance 2 x 24); the slower of two such sums is
    longer by sd x 0.589 (Blom), per wave sqrt(24 / 2) x 0.589."""
    lengths = GenLengths(max_len=20, histogram=((3, 1.0), (12, 1.0), (20, 2.0)))
    g = gen(20, lengths)
    assert expected_call_tokens(g, 1, 1, 1) == pytest.approx(16.0)
    assert expected_call_tokens(g, 1, 1, 2) == pytest.approx(18.5)
    mean, var = wave_token_moments(g, 1)                      # 16 and 24
    assert (mean, var) == (pytest.approx(16.0), pytest.approx(64 / 4 + 256 / 4 + 400 / 2 - 256))
    assert expected_call_tokens(g, 1, 2, 1) == pytest.approx(16.0)
    assert expected_call_tokens(g, 1, 2, 2) == pytest.approx(
        16.0 + (var / 2) ** 0.5 * expected_max_std_normal(2))
    # fixed lengths or none: no spread, no wait
    assert expected_call_tokens(gen(20, fixed(20, 3)), 4, 3, 8) == pytest.approx(8.0)
    assert expected_call_tokens(gen(20), 4, 3, 8) == 20.0


@pytest.mark.parametrize("n,expected", [(1, 0.0), (2, 0.589), (4, 1.049), (8, 1.434)])
def test_expected_max_of_normals(n, expected):
    # Blom's approximation (exact values: 0, 0.564, 1.029, 1.424)
    assert expected_max_std_normal(n) == pytest.approx(expected, abs=2e-3)


@pytest.mark.parametrize("kwargs,msg", [
    ({"max_len": 8}, "mean or a histogram"),
    ({"max_len": 8, "mean": 9.0}, "exceeds max_len"),
    ({"max_len": 8, "histogram": ((9, 1.0),)}, "1..8"),
    ({"max_len": 8, "histogram": ((2, -1.0),)}, "1..8"),
    ({"max_len": 8, "histogram": ((2, 0.0),)}, "no weight"),
])
def test_invalid_distributions_are_rejected(kwargs, msg):
    with pytest.raises(ValidationError, match=msg):
        GenLengths(**kwargs)


@pytest.mark.parametrize("cap,max_len,tokens", [
    (8, 16, 8.0),               # every wave stops at the first check
    (8, 4, 8.0),
    (12, 16, 0.5 * 8 + 0.5 * 12),   # half stop at 8; lengths 9..16 run to the cap, 12
])
def test_lengths_recorded_under_another_cap(cap, max_len, tokens):
    """A distribution recorded under another cap (uniform on 1..max_len): a length past
    gen_len stops at gen_len."""
    lengths = GenLengths(max_len=max_len, histogram=tuple((x, 1.0) for x in range(1, max_len + 1)))
    assert expected_wave_tokens(gen(cap, lengths), 1) == pytest.approx(tokens)
