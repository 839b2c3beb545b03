"""A packed train call at EP > 1 gets a fixed micro-batch count, never a token budget:
a budget's bin count is each data-parallel rank's own, while the ranks of an EP group
exchange tokens in every micro-batch of a train step (realign's train engine refuses a
budget at EP > 1). At EP 1 the same call keeps its budgets."""
from __future__ import annotations

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.packing import packed_graph
from planner.search.problem import RoleModel, build_problem
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.model_spec import ModelSpec, MoeSpec

pytestmark = pytest.mark.pure

MOE = ModelSpec(name="toy-moe", family="qwen3_moe", n_layers=4, hidden=64, n_heads=4,
                n_kv_heads=2, ffn_hidden=128, vocab_size=128, qk_norm=True,
                moe=MoeSpec(n_experts=8, top_k=2, expert_ffn_hidden=32))


def test_packed_train_call_at_ep_above_1_has_no_token_budget():
    graph = packed_graph(build_graph("grpo", BatchShape(
        prompts_per_step=8, samples_per_prompt=4, prompt_len=32, gen_len=64), {"actor"}))
    train_i = next(i for i, m in enumerate(graph.mfcs) if m.kind == "train")
    assert graph.mfcs[train_i].packed and graph.mfcs[train_i].micro_batches is None
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=4, device=resolve_device("h100-80g"))
    prob = build_problem(graph, {"actor": RoleModel("actor", MOE, "lm")},
                         CostModel(cluster, CostModelConfig()))
    train = prob.cands[train_i]
    at_ep = [c for c in train if c.ep > 1]
    assert at_ep and all(c.token_budget is None for c in at_ep)
    assert any(c.token_budget is not None for c in train if c.ep == 1)
