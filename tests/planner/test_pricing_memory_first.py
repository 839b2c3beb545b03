"""The search prices a candidate's time only when its memory fits
(:meth:`planner.cost.cost_model.CostModel.mfc_bytes` before ``mfc_cost``): fewer calls of
the cost model's time, the same candidates and the same plan."""
from __future__ import annotations

from itertools import product

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.mfc_cost import MFCBytes, MFCCost
from planner.cost.offload_terms import offload_options, state_offload_options
from planner.graph.algorithms import BatchShape, build_graph
from planner.search.problem import RoleModel, build_problem, head_of
from planner.search.search import SearchSettings, search
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import enumerate_layouts
from planner.specs.lora import LoraSpec
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure


class CountingCost(CostModel):
    """A cost model that counts its priced calls (``mfc_cost``)."""

    calls = 0

    def mfc_cost(self, *a, **k):
        self.calls += 1
        return super().mfc_cost(*a, **k)


class PriceEverything(CountingCost):
    """Memory from the whole price, as a search that prices every candidate does."""

    def mfc_bytes(self, mfc, spec, head, mesh, layout, micro_batches, offload=False,
                  state_offload=False, recompute=False, engine="own", lora=None,
                  token_budget=None):
        return self.mfc_cost(mfc, spec, head, mesh, layout, micro_batches, offload,
                             state_offload, recompute, engine, lora, token_budget)


def ppo_case() -> tuple:
    """PPO with four LLaMA-2 13B on one node of 8 A100-80G: about a third of the
    allocations priced overflow the GPU (TP1, few micro-batches)."""
    presets = model_presets()
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("a100-80g"))
    roles = ("actor", "critic", "ref", "reward")
    models = {r: RoleModel(r, presets["llama2-13b"], head_of(r)) for r in roles}
    graph = build_graph("ppo", BatchShape(prompts_per_step=128, prompt_len=128, gen_len=512,
                                          ppo_minibatches=2), set(roles))
    return graph, models, cluster


def test_memory_first_prices_fewer_calls_and_keeps_every_candidate():
    graph, models, cluster = ppo_case()
    lean, full = CountingCost(cluster), PriceEverything(cluster)
    a = build_problem(graph, models, lean, n_iters=2)
    b = build_problem(graph, models, full, n_iters=2)
    assert a.cands == b.cands
    assert sum(len(c) for c in a.cands) > 0
    # a candidate that does not fit is not priced in time: fewer calls to the pricer
    assert lean.calls < 0.8 * full.calls, (lean.calls, full.calls)


def test_memory_first_keeps_the_plan(monkeypatch):
    graph, models, cluster = ppo_case()
    settings = SearchSettings(method="anneal", seed=0, n_iters=2, time_limit_s=120,
                              anneal_steps=20_000)
    plans = []
    for cls in (CountingCost, PriceEverything):
        monkeypatch.setattr("planner.search.search.CostModel", cls)
        plans.append(search("ppo", graph, models, cluster, settings=settings))
    assert plans[0].allocations == plans[1].allocations
    assert plans[0].iteration_time_s == plans[1].iteration_time_s


FIELDS = ("weights_bytes", "resident_bytes", "activation_bytes", "host_bytes",
          "adapter_bytes")


@pytest.mark.parametrize("lora", [None, LoraSpec(rank=16)])
def test_mfc_bytes_equals_the_price_memory(lora):
    """Every option the search prices (offload, training-state offload, recompute,
    micro-batches, LoRA, DAPO's sampling rounds): the memory without the time equals the
    memory of the whole price, exactly."""
    presets = model_presets()
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g"))
    cost = CostModel(cluster, CostModelConfig())
    spec = presets["llama2-7b"]
    graph = build_graph("ppo", BatchShape(prompts_per_step=64, prompt_len=128, gen_len=256,
                                          ppo_minibatches=2), {"actor", "critic", "ref",
                                                               "reward"})
    mesh = DeviceMesh(first_gpu=0, n_gpus=8)
    checked = 0
    for mfc in graph.mfcs:
        for rounds in (1.0, 1.5) if mfc.kind != "train" else (1.0,):
            m = mfc.model_copy(update={"sampling_rounds": rounds})
            for lay in enumerate_layouts(mesh, spec, m, cluster)[:4]:
                for mb, off, st, rc in product((1, 2), offload_options(cost.config, cluster.device, m),
                                               state_offload_options(cost.config, cluster.device, m),
                                               cost.recompute_options(m)):
                    args = (m, spec, head_of(m.role), mesh, lay, mb, off, st, rc, "own", lora)
                    b, c = cost.mfc_bytes(*args), cost.mfc_cost(*args)
                    assert isinstance(b, MFCBytes) and isinstance(c, MFCCost)
                    assert [getattr(b, f) for f in FIELDS] == [getattr(c, f) for f in FIELDS]
                    checked += 1
    assert checked > 50
