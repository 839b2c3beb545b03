"""vLLM's decode step as the run's engine ran it: eager (no CUDA graphs: a host cost
per layer) and v0's synchronous scheduler (a host gap on every decode step)."""
from __future__ import annotations

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.vllm_cost import (
    VLLM_ASYNC_STEP_GAP_S,
    VLLM_SYNC_STEP_S,
    concurrency,
    decode_schedule,
)
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure


def gen(n: int = 256, prompt: int = 512, cap: int = 1024) -> MFC:
    return MFC(name="actor.generate", role="actor", kind="generate", n_seqs=n,
               prompt_len=prompt, gen_len=cap, input_keys=("prompts",),
               output_keys=("seqs", "logprobs"))


def priced(device: str, **cfg: object):
    spec = model_presets()["qwen2.5-1.5b"]
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device(device))
    cost = CostModel(cluster, CostModelConfig(generate_engine="vllm",
                                              vllm_kv_cache_bytes=40 * 2 ** 30, **cfg))
    c = cost.mfc_cost(gen(), spec, "lm", DeviceMesh(first_gpu=0, n_gpus=1),
                      Layout(tp=1, pp=1, dp=1), 1, engine="vllm")
    return cost, spec, c


def test_graphs_by_default_eager_pays_the_devices_per_layer_decode_cost():
    for device in ("a100-80g", "h200"):
        graphs, _, _ = priced(device)
        eager, _, _ = priced(device, vllm_enforce_eager=True)
        dev = graphs.cluster.device
        assert graphs.rates.engine("vllm_decode").layer_s == 0.0
        assert eager.rates.engine("vllm_decode").layer_s == dev.decode_layer_overhead_s
        assert "eager" in eager.rates.sources["engine vllm_decode"]


def test_an_eager_small_model_step_is_host_bound_alike_on_a100_and_h200():
    """1.5B at 256 rows: the eager step is paced by the host's launches (28 layers x
    1.2 ms), not by the GPU, so A100 and H200 price the same decode; with graphs the
    H200 (2.4x the memory bandwidth) is faster."""
    a_graph = priced("a100-80g")[2].terms_s["decode_gemm"]
    h_graph = priced("h200")[2].terms_s["decode_gemm"]
    assert h_graph < a_graph / 2
    a, spec, ca = priced("a100-80g", vllm_enforce_eager=True)
    _, _, ch = priced("h200", vllm_enforce_eager=True)
    steps, _ = decode_schedule(gen(), 256, concurrency(a, spec, gen()))
    host = steps * spec.n_layers * a.cluster.device.decode_layer_overhead_s
    assert ca.terms_s["decode_fixed"] == pytest.approx(ch.terms_s["decode_fixed"], rel=0.01)
    assert ca.terms_s["decode_fixed"] >= host
    assert ca.terms_s.get("decode_gemm", 0.0) == 0.0      # hidden behind the host


def test_a_synchronous_scheduler_adds_its_gap_to_every_decode_step():
    cost, spec, async_c = priced("h200")
    _, _, sync_c = priced("h200", vllm_scheduler="sync")
    steps, _ = decode_schedule(gen(), 256, concurrency(cost, spec, gen()))
    assert "decode_host_sync" not in async_c.terms_s
    assert "decode_host_gap" not in sync_c.terms_s
    assert sync_c.terms_s["decode_host_sync"] == pytest.approx(steps * VLLM_SYNC_STEP_S)
    assert sync_c.time_s - async_c.time_s == pytest.approx(
        steps * (VLLM_SYNC_STEP_S - VLLM_ASYNC_STEP_GAP_S))
