"""The profile's passes over its probes (realign.profile.passes): pooling each probe's
samples, and how much the machine's speed moved between passes."""
from __future__ import annotations

import statistics

import pytest

from realign.profile.passes import cellwise, pass_time_ratios, pooled_median, speed_moved

pytestmark = pytest.mark.pure


def test_a_slow_pass_moves_the_pooled_median_no_more_than_one_slow_sample():
    fast, slow = [1.0, 1.1, 1.0], [2.0, 2.1, 2.0]
    assert pooled_median([fast, slow, [1.0, 0.9, 1.0]]) == 1.0
    # timed in one go, the probe would have caught one phase: 1.0 or 2.0
    assert pooled_median([slow, slow, fast]) == 2.0


def test_pass_ratios_are_the_median_over_probes_of_each_pass_against_its_pool():
    a = [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]]
    b = [[3.0, 3.0], [6.0, 6.0], [3.0, 3.0]]
    assert pass_time_ratios([a, b]) == [1.0, 2.0, 1.0]
    # one probe disturbed in the first pass does not make the pass slow
    c = [[9.0, 9.0], [1.0, 1.0], [1.0, 1.0]]
    d = [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    assert pass_time_ratios([c, d, d]) == [1.0, 1.0, 1.0]
    assert pass_time_ratios([]) == []


def test_speed_moved_is_the_slowest_pass_over_the_fastest():
    assert speed_moved([1.0, 1.3, 0.95]) == pytest.approx(1.3 / 0.95 - 1)
    assert speed_moved([1.0]) == 0.0 and speed_moved([]) == 0.0


def test_grids_are_reduced_cell_by_cell():
    grids = [((1.0, 4.0), (5.0, 5.0)), ((3.0, 2.0), (1.0, 6.0)), ((2.0, 3.0), (9.0, 7.0))]
    assert cellwise(grids) == ((2.0, 3.0), (5.0, 6.0))
    assert cellwise(grids, statistics.fmean) == ((2.0, 3.0), (5.0, 6.0))
    assert cellwise(grids[:2], statistics.fmean) == ((2.0, 3.0), (3.0, 5.5))
