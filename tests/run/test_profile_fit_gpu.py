"""The profile's engine fit on a device that runs kernels asynchronously (a GPU),
without one: probe times made by the cost model from known host costs are fitted back
to those costs, and the device's memory-traffic costs keep their analytic values."""
from __future__ import annotations

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.engine_terms import DEVICE_FIXED, HOST_FIXED
from planner.cost.profile import EngineCosts, GemmGrid, ProfileTable
from planner.cost.rates import Rates
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from realign.profile import engines as E
from realign.profile.run import ProfileSettings, _probes, fit_engines

pytestmark = pytest.mark.torch

GRID = GemmGrid(rows=(1, 16384), widths=(64, 8192),
                forward_flops_per_s=((1e10, 1e11), (1e13, 7e14)),
                train_flops_per_s=((5e9, 5e10), (5e12, 6e14)))
BASE = ProfileTable(device="h100-80g", gemm=GRID, mem_bytes_per_s=3e12)
SETTINGS = ProfileSettings("cuda", "h100-80g", 1, 1, "bf16")
TRUE_HOST = {"inference": EngineCosts(call_s=3e-4, microbatch_s=3e-4, layer_s=3.5e-4,
                                      token_s=1e-8),
             "train": EngineCosts(call_s=2.4e-3, microbatch_s=2.2e-3, layer_s=2.7e-3)}


def _analytic(kind: str) -> EngineCosts:
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("h100-80g"))
    return Rates(cluster, CostModelConfig(param_dtype_bytes=2, distributed_optimizer=False),
                 BASE).engine(kind)


def _measured(kind: str, cases) -> list[float]:
    """What the plans' cost model (overlap included) says each probe takes."""
    truth = _analytic(kind).model_copy(update={f: getattr(TRUE_HOST[kind], f) for f in HOST_FIXED})
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("h100-80g"))
    cm = CostModel(cluster, CostModelConfig(param_dtype_bytes=2, distributed_optimizer=False),
                   BASE.model_copy(update={"engines": {kind: truth}}))
    return [cm.mfc_cost(mfc, E.probe_spec(*dims), "lm", DeviceMesh(first_gpu=0, n_gpus=1),
                        Layout(), m).time_s for _f, _a, (dims, _lay, mfc, m) in cases]


@pytest.mark.parametrize("kind", ["inference", "train"])
def test_gpu_fit_recovers_host_costs_and_keeps_device_costs_analytic(kind):
    cases = _probes(1, "cuda")[kind]
    assert any(dims == E.GPU_PROBE_MODELS[0] for _f, _a, (dims, *_r) in cases)
    costs, rms, pred = fit_engines(BASE, SETTINGS, kind, cases, _measured(kind, cases))
    got = costs[kind]
    # the probes' passes are host-bound, so their times are the host's costs; training's
    # optimizer step (device traffic outside the passes, a few us on these probes) is
    # taken up by them within 1 %
    rel = 1e-2 if kind == "train" else 1e-6
    for f in HOST_FIXED:
        assert getattr(got, f) == pytest.approx(getattr(TRUE_HOST[kind], f), rel=rel, abs=1e-12)
    for f in DEVICE_FIXED:
        assert getattr(got, f) == getattr(_analytic(kind), f)
    assert rms < rel and len(pred) == len(cases)


def test_cpu_probes_have_no_gpu_extras():
    cpu, gpu = _probes(2, "cpu"), _probes(2, "cuda")
    assert len(gpu["generate"]) > len(cpu["generate"]) and len(gpu["train"]) > len(cpu["train"])
