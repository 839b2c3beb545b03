"""Expert parallelism with pipeline parallelism on four gloo ranks, fp32, against
transformers: PP2·DP2·EP2 of a 4-layer Qwen3-MoE whose first stage holds only sparse
layers and whose last stage only dense ones (``mlp_only_layers`` [2, 3]: the last
stage's ranks hold no experts and exchange no tokens), and of one with a sparse layer
on each stage (``mlp_only_layers`` [1])."""
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
def pp_models(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    root = tmp_path_factory.mktemp("moe_pp_ep4")
    arch = dict(TINY_QWEN3_MOE, initializer_range=0.3, num_hidden_layers=4)  # clear top-k
    return {
        "split": str(make_model(root / "split", "qwen3_moe", seed=21,
                                arch=dict(arch, mlp_only_layers=[2, 3]))),
        "mixed": str(make_model(root / "mixed", "qwen3_moe", seed=22,
                                arch=dict(arch, mlp_only_layers=[1]))),
    }


@pytest.mark.parametrize("model,held", [
    ("split", [[0, 1, 2, 3], [4, 5, 6, 7], [], []]),
    ("mixed", [[0, 1, 2, 3], [4, 5, 6, 7]] * 2),
])
def test_pp2_ep2_logits_match_transformers(world4, pp_models, model, held):
    got = world4.run("cases_moe_ep:logits_parity", pp_models[model], 1, 2, 2, 8, 2)
    assert [r[3] for r in got] == [0, 1, 0, 1] and [r[2] for r in got] == held
    for logits_diff, lp_diff, _, _ in got:
        assert logits_diff < TOL and lp_diff < TOL, (model, logits_diff, lp_diff)
