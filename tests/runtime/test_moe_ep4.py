"""Expert parallelism on four gloo ranks, fp32, against transformers: TP2·DP2·EP2 (the
experts split over TP inside each EP rank, the ranks of one TP position exchanging
tokens) and DP4·EP2 (two EP groups, each expert held by two expert-data-parallel ranks)."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cpu_dist, pytest.mark.slow]

TOL = 1e-4


@pytest.fixture(scope="module")
def world4():
    from realign.runtime.local_world import LocalWorld

    with LocalWorld(4, timeout_s=240) as w:
        yield w


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    arch = dict(TINY_QWEN3_MOE, initializer_range=0.3)   # clear top-k margins
    return str(make_model(tmp_path_factory.mktemp("moe_ep4") / "moe", "qwen3_moe", seed=11,
                          arch=arch))


@pytest.mark.parametrize("tp,dp,ep_ranks,held", [
    (2, 2, [0, 0, 1, 1], [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2),
    (1, 4, [0, 1, 0, 1], [[0, 1, 2, 3], [4, 5, 6, 7]] * 2),
])
def test_ep2_with_tp_or_dp_logits_match_transformers(world4, moe_path, tp, dp, ep_ranks, held):
    got = world4.run("cases_moe_ep:logits_parity", moe_path, tp, dp, 2, 8)
    assert [r[3] for r in got] == ep_ranks and [r[2] for r in got] == held
    for logits_diff, lp_diff, _, _ in got:
        assert logits_diff < TOL and lp_diff < TOL, (tp, dp, logits_diff, lp_diff)
