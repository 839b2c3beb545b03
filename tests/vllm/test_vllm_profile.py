"""`realign profile`'s vLLM part: vLLM timed on its probe models, its fixed costs and
its weight load fitted through the planner's own pricing, and a plan priced with them
says so."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_probes_fit_the_planners_vllm_terms():
    from planner.cost.cost_config import CostModelConfig
    from planner.cost.cost_model import CostModel
    from planner.cost.profile import ProfileTable
    from planner.specs.cluster import ClusterSpec, resolve_device
    from realign.profile.vllm_probe import (
        VLLM_BATCHES,
        VLLM_PROBE_MODELS,
        fit_vllm,
        fit_vllm_load,
        probe_points,
        time_vllm,
    )

    timed, loads = time_vllm("cpu", "fp32", 1)
    assert [(d, c) for d, c, _ in timed] == [(d, c) for d in VLLM_PROBE_MODELS
                                             for c in VLLM_BATCHES]
    assert all(t > 0 for *_, t in timed)
    # one load per probe model, a larger model's load the more bytes
    assert len(loads) == len(VLLM_PROBE_MODELS)
    assert all(b[2] > a[2] > 0 for a, b in zip(loads, loads[1:]))
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("cpu"))
    costs, rms, pred = fit_vllm(ProfileTable(device="cpu"), cluster, 4, timed)
    assert set(costs) == {"vllm_prefill", "vllm_decode"}
    assert all(v >= 0 for c in costs.values() for v in c.model_dump().values())
    assert len(pred) == len(timed) and rms >= 0
    load = fit_vllm_load(loads)
    assert load.bytes_per_s > 0 and load.fixed_s >= 0
    points = probe_points(timed, pred)
    assert {p.engine for p in points} == {"vllm"}
    table = ProfileTable(device="cpu", engines=costs, vllm_load=load)
    rates = CostModel(cluster, CostModelConfig(generate_engine="auto"), table).rates
    assert rates.sources["engine vllm_decode"] == "profile"
    assert rates.sources["vllm weight load"] == "profile"
