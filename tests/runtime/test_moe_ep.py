"""Expert parallelism in the runtime on real gloo ranks, fp32, against transformers: the
tiny Qwen3-MoE (8 experts, top 2) with its experts spread over EP groups carved out of
the data-parallel ranks, tokens exchanged by all_to_all. Two ranks: EP2 on one batch and
DP2·EP2 with a batch per data-parallel rank; four ranks: TP2·DP2·EP2 and DP4·EP2."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu_dist

TOL = 1e-4


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    arch = dict(TINY_QWEN3_MOE, initializer_range=0.3)   # clear top-k margins
    return str(make_model(tmp_path_factory.mktemp("moe_ep") / "moe", "qwen3_moe", seed=11,
                          arch=arch))


@pytest.mark.parametrize("n", [4, 8])
def test_dp2_ep2_logits_match_transformers(world2, moe_path, n):
    """Each data-parallel rank scores its own rows; half the experts on each."""
    got = world2.run("cases_moe_ep:logits_parity", moe_path, 1, 2, 2, n)
    assert [r[3] for r in got] == [0, 1]
    assert [r[2] for r in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for logits_diff, lp_diff, _, _ in got:
        assert logits_diff < TOL and lp_diff < TOL, (n, logits_diff, lp_diff)


def test_ep2_ranks_hold_and_load_only_their_experts(world2, moe_path):
    (names0, worst0), (names1, worst1) = world2.run("cases_moe_ep:held_tensors", moe_path,
                                                    1, 2, 2)
    assert worst0 == 0.0 and worst1 == 0.0
    assert names0 and names1 and not set(names0) & set(names1)
    assert all(".local_experts.5." not in n for n in names0)
    assert any(".local_experts.5." in n for n in names1)


def test_checkpoint_saved_from_ep2_holds_every_expert(world2, moe_path, tmp_path):
    """Written from DP2·EP2 (the writer gathers the other EP rank's experts): every
    tensor of the source checkpoint, and realign reads it back with transformers'
    logits."""
    import json
    from pathlib import Path

    out = str(tmp_path / "out")
    names = world2.run("cases_moe_ep:save_from_ep", moe_path, out, 1, 2, 2)[0]
    src = json.loads(next(Path(moe_path).glob("*.index.json")).read_text())["weight_map"] \
        if list(Path(moe_path).glob("*.index.json")) else None
    assert any(".experts.7." in n for n in names) and any(".experts.0." in n for n in names)
    if src is not None:
        assert names == sorted(src)
    for logits_diff, lp_diff, _ in filter(None, world2.run("cases_moe:logits_parity",
                                                           out, 1, 1)):
        assert logits_diff < TOL and lp_diff < TOL


def test_dp2_ep2_packed_scores_with_uneven_bins_equal_ep1(world2, moe_path):
    """Packed scoring with a token budget: rank 0's long rows take four bins, rank 1's
    short ones one; the rank that has finished joins the other's remaining exchanges
    (realign.runtime.engines.ep_lockstep), and the log-probs equal DP2·EP1's."""
    ep1 = world2.run("cases_moe_ep:packed_scores", moe_path, 2, 1, 16)
    ep2 = world2.run("cases_moe_ep:packed_scores", moe_path, 2, 2, 16)
    assert [r[1] for r in ep2] == [4, 1]
    for (lp1, _), (lp2, _) in zip(ep1, ep2):
        assert float((lp1 - lp2).abs().max()) < 1e-5
