"""Training on token-budget bins: for every algorithm and trained role, the gradient of
one mini-batch packed into bins of a token budget (micro-batches of different row and
token counts, data-parallel ranks with different numbers of them) equals, to float
tolerance, the gradient with the plan's rows per micro-batch, and both equal the
gradient of the whole mini-batch in one micro-batch: every loss's normalisation (token
means over the mini-batch, sequence means weighted by rows, pairs kept whole) is exact
across splits."""
from __future__ import annotations

import pytest

from realign.algorithms.registry import ALGORITHMS

pytestmark = pytest.mark.cpu_dist

#: float32 gradients summed in a different order
ATOL, RTOL = 1e-6, 1e-4
#: one micro-batch, the plan's two equal ones, then bins of two token budgets (the
#: smallest holds a row, or a preference pair, at its cap of 24 tokens)
SETTINGS = {1: [(1, None), (2, None), (1, 32), (1, 48)],
            2: [(1, None), (2, None), (1, 48), (1, 96)]}
GROUP = {"dpo": 2, "rm": 2, "online_dpo": 2}
CASES = [(name, role) for name, algo in ALGORITHMS.items() for role in algo.trained_roles]


def _close(a, b):
    return bool(((a - b).abs() <= ATOL + RTOL * b.abs()).all())


@pytest.mark.parametrize("name,role", CASES)
def test_budget_bins_give_the_gradient_of_rows_per_micro_batch(world2, tiny_models, name, role):
    head = "lm" if role == "actor" else "value"
    path = tiny_models["llama" if head == "lm" else "llama_rm"]
    group = GROUP.get(name, 1)
    by_dp = {}
    for dp in (1, 2):
        res = [r for r in world2.run("cases_train_budget:gradients", path, head, dp, name,
                                     role, SETTINGS[group]) if r is not None]
        assert res
        by_dp[dp] = res
    whole, loss = by_dp[1][0][0][:2]      # DP1, the mini-batch in one micro-batch
    assert whole.abs().max() > 1e-4       # the loss has a gradient
    for dp, res in by_dp.items():
        for rank in res:
            for (micro, budget), (grad, step_loss, _) in zip(SETTINGS[group], rank):
                assert _close(grad, whole), (dp, micro, budget, (grad - whole).abs().max())
                assert abs(step_loss - loss) <= 1e-5 * max(1.0, abs(loss))
    # the budgets' bins hold different numbers of rows (whole pairs), and (but where
    # prepare keeps 8 rows of the 16: 4 a rank) data-parallel ranks run different
    # numbers of bins
    bins = [[rank[i][2] for rank in by_dp[dp]] for dp in (1, 2) for i in (2, 3)]
    assert all(r % group == 0 for b in bins for rank in b for r in rank), bins
    assert any(len(set(rank)) > 1 for b in bins for rank in b), bins
    if name not in ("dapo", "rejection_sampling"):
        assert any(len({len(rank) for rank in b}) > 1 for b in bins[2:]), bins
