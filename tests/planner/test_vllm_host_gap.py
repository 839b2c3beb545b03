"""vLLM V1's per-step host gap: the asynchronous scheduler's device idle between two
decode steps with CUDA graphs, priced once per decode step at the figure
docs/gpu-terms.md cites (vllm-project/vllm PR #11133)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.vllm_cost import VLLM_ASYNC_STEP_GAP_S, concurrency, decode_schedule
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

DOCS = Path(__file__).resolve().parents[2] / "docs" / "gpu-terms.md"


def gen(n: int, cap: int) -> MFC:
    return MFC(name="actor.generate", role="actor", kind="generate", n_seqs=n,
               prompt_len=256, gen_len=cap, input_keys=("prompts",),
               output_keys=("seqs", "logprobs"))


def priced(device: str, mfc: MFC, **cfg: object):
    spec = model_presets()["qwen2.5-1.5b"]
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device(device))
    cost = CostModel(cluster, CostModelConfig(generate_engine="vllm",
                                              vllm_kv_cache_bytes=40 * 2 ** 30, **cfg))
    c = cost.mfc_cost(mfc, spec, "lm", DeviceMesh(first_gpu=0, n_gpus=1),
                      Layout(tp=1, pp=1, dp=1), 1, engine="vllm")
    return cost, spec, c


def test_the_gap_is_paid_once_per_decode_step():
    """Fixed lengths: a call of 64 sequences at caps 128 and 512 takes cap - 1 decode
    steps (all fit at once); the gap term is that many times the constant, and it is
    the whole difference the gap makes to the call."""
    for cap in (128, 512):
        mfc = gen(64, cap)
        cost, spec, c = priced("h100-80g", mfc)
        steps, _ = decode_schedule(mfc, 64, concurrency(cost, spec, mfc))
        assert steps == cap - 1
        assert c.terms_s["decode_host_gap"] == pytest.approx(steps * VLLM_ASYNC_STEP_GAP_S)
        others = sum(v for k, v in c.terms_s.items() if k != "decode_host_gap")
        assert c.time_s == pytest.approx(others + steps * VLLM_ASYNC_STEP_GAP_S)


def test_no_gap_where_the_step_is_not_a_replayed_graph_on_a_gpu():
    mfc = gen(64, 128)
    assert "decode_host_gap" not in priced("cpu", mfc)[2].terms_s
    assert "decode_host_gap" not in priced("h100-80g", mfc, vllm_enforce_eager=True)[2].terms_s
    assert "decode_host_gap" not in priced("h100-80g", mfc, vllm_scheduler="sync")[2].terms_s


def test_the_constant_is_the_figure_the_docs_cite():
    """docs/gpu-terms.md's row for the term names PR #11133 and its 150-170 us gap; the
    constant is that range's midpoint."""
    row = next(line for line in DOCS.read_text().splitlines()
               if line.startswith("| `decode_host_gap`"))
    assert "vllm-project/vllm" in row and "#11133" in row
    lo, hi = (float(x) for x in re.search(r"(\d+)-(\d+)us", row).groups())
    assert (lo, hi) == (150.0, 170.0)
    assert VLLM_ASYNC_STEP_GAP_S == pytest.approx((lo + hi) / 2 * 1e-6)
    assert f"{VLLM_ASYNC_STEP_GAP_S * 1e6:.0f} µs" in row
