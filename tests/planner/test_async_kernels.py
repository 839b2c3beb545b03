"""A device that runs kernels asynchronously (a GPU): one stage pass costs the longer
of the host's fixed costs and the device's work, not their sum; attention is one
batched GEMM over the heads. Hand computations on
the toy device and model of test_cost_model.py."""
from __future__ import annotations

import pytest

from planner.cost.cost_model import CostModel
from planner.cost.engine_terms import DEVICE_FIXED, FIXED, HOST_FIXED, Work, overlapped, stage_pass
from planner.cost.profile import EngineCosts, GemmGrid, ProfileTable
from planner.cost.rates import Rates
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from tests.planner.test_cost_model import DEV, EXACT, HID_S, TOY, VOCAB_S, H, approx, mesh, mfc

pytestmark = pytest.mark.pure

ASYNC = DEV.model_copy(update={"async_kernels": True})


def test_host_and_device_fixed_costs_split_every_fixed_cost():
    assert set(HOST_FIXED) | set(DEVICE_FIXED) == set(FIXED)
    assert not set(HOST_FIXED) & set(DEVICE_FIXED)


def test_overlapped_keeps_the_longer_side():
    costs = EngineCosts(layer_s=5e-4, token_hidden_s=1e-9)
    host_bound = Work(seconds={"gemm": 4e-4}, counts={"layer_s": 3, "token_hidden_s": 1e5})
    got = overlapped(host_bound, costs)            # host 1.5 ms > device 0.4 + 0.1 ms
    assert got.total(costs) == approx(1.5e-3) and got.seconds == {}
    device_bound = Work(seconds={"gemm": 2e-3}, counts={"layer_s": 3, "token_hidden_s": 1e5})
    got = overlapped(device_bound, costs)          # device 2.0 + 0.1 ms > host 1.5 ms
    assert got.total(costs) == approx(2.1e-3)
    assert got.seconds == {"gemm": 2e-3} and got.counts == {"token_hidden_s": 1e5}


def test_a_pass_on_an_async_device_costs_the_longer_of_host_and_device():
    """Inference of 8 x 48 tokens on one GPU, one micro-batch: the call's cost, then one
    pass. Host: micro-batch 100 us + 4 layers x 10 us = 140 us; device: the GEMMs,
    attention and the per-token traffic of test_inference_one_gpu (~93 us), so the host
    paces the pass; with 10x the rows the device does."""
    def priced(device, seqs):
        cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=1, device=device), EXACT)
        return cm.mfc_cost(mfc("inference", n_seqs=seqs), TOY, "lm", mesh(1), Layout(), 1)
    for seqs in (8, 80):
        rows = seqs * 48
        host = 1e-4 + 4 * 1e-5
        device = (rows * 2 * 155648 + rows * 1024 * 24) / 1e12 + (
            4 * rows * H * HID_S + rows * 128 * VOCAB_S)
        assert priced(DEV, seqs).time_s == approx(1e-3 + host + device)
        assert priced(ASYNC, seqs).time_s == approx(1e-3 + max(host, device))
        assert (host > device) == (seqs == 8)


def test_attention_is_one_gemm_over_all_heads():
    """With a measured GEMM grid the rate grows with the rows, so a batched call over 4
    heads (4 x 384 rows) runs at the rate of 1536 rows, not of 384."""
    grid = GemmGrid(rows=(1, 100000), widths=(1, 100000),
                    forward_flops_per_s=((1e9, 1e9), (1e14, 1e14)),
                    train_flops_per_s=((1e9, 1e9), (1e14, 1e14)))
    r = Rates(ClusterSpec(n_nodes=1, gpus_per_node=1, device=DEV), EXACT,
              ProfileTable(device="toy", gemm=grid, mem_bytes_per_s=1e12))
    rows, ctx = 384.0, 24.0
    w = stage_pass(r, TOY, "lm", "inference", rows, ctx, rows, 1, 4, True, True)
    per_layer = 2 * (2 * 4 * rows * 16 * ctx) / grid.rate(4 * rows, (16 * ctx) ** 0.5, False)
    assert w.seconds["attention"] == approx(4 * per_layer)


def test_gpu_presets_run_kernels_asynchronously_and_the_cpu_does_not():
    assert all(resolve_device(d).async_kernels for d in ("a100-80g", "h100-80g", "h200"))
    assert not resolve_device("cpu").async_kernels
    assert all("async_kernels" in resolve_device(d).sources for d in ("a100-80g", "h100-80g"))
