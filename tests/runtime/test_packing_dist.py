"""Packed scoring and training equal the padded ones on real gloo ranks: log-probs and
values, losses (same per-token terms, same normalisation), grad norms and the weights
after two steps, at TP1, TP2, PP2 and DP2, for an LM and a value head; and scoring
packed by a plan's token budget, at TP1 and at DP2 with ranks that pack different
numbers of bins."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu_dist

TOL = 2e-5


@pytest.mark.parametrize("model,head,tp,pp,dp,micro", [
    ("llama", "lm", 1, 1, 1, 2), ("qwen2", "lm", 2, 1, 1, 2), ("llama_tied", "lm", 1, 2, 1, 2),
    ("llama", "lm", 1, 1, 2, 1), ("llama_rm", "value", 1, 2, 1, 2)])
def test_packed_step_equals_padded_step(world2, tiny_models, model, head, tp, pp, dp, micro):
    res = [r for r in world2.run("cases_packing:padded_vs_packed", tiny_models[model], head,
                                 tp, pp, dp, micro) if r is not None]
    assert res
    for before, metrics, after, scale, losses in res:
        assert scale > 0.1                     # the outputs are not all zero
        assert before < TOL                    # log-probs / values equal
        # after two Adam steps: Adam divides each gradient by its own scale, so rounding
        # differences of near-zero gradients grow to a few lr-sized units
        assert after < 1e-3
        assert metrics < TOL                   # losses and grad norms equal (relative)
        assert losses[0] != losses[1]          # the first step changed the weights


@pytest.mark.parametrize("head,dp,lengths", [
    ("lm", 1, None),
    # DP rank 0's rows 24, 17, 12, 9 take three bins of 32, rank 1's 2, 3, 5, 7 one
    ("lm", 2, (24, 17, 12, 9, 2, 3, 5, 7)),
    ("value", 2, (24, 17, 12, 9, 2, 3, 5, 7))])
def test_scoring_packed_by_a_token_budget_equals_padded(world2, tiny_models, head, dp, lengths):
    model = "llama" if head == "lm" else "llama_rm"
    res = [r for r in world2.run("cases_packing:padded_vs_packed", tiny_models[model], head,
                                 1, 1, dp, 1, 32, lengths) if r is not None]
    assert res
    for before, _, after, scale, _ in res:
        assert scale > 0.1 and before < TOL and after < 1e-3
