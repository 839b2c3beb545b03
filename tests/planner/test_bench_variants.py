"""`realign bench plans`' variants on a one-GPU cluster (no layouts or splits to vary):
the micro-batch counts in between give it distinct plans to measure."""
from __future__ import annotations

import pytest

from planner.graph.algorithms import BatchShape, build_graph
from planner.search.problem import RoleModel, head_of
from planner.search.variants import bench_plans, signature
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure


def test_one_gpu_gets_the_micro_batch_ladder():
    roles = ("actor", "ref")
    graph = build_graph("grpo", BatchShape(prompts_per_step=8, prompt_len=16, gen_len=16,
                                           ppo_minibatches=1), set(roles))
    models = {r: RoleModel(r, model_presets()["tiny-llama"], head_of(r)) for r in roles}
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("h100-80g"))
    plans = bench_plans("one-gpu", graph, models, cluster, n=8)
    labels = [p.label for p in plans]
    assert "variant all TP1·PP1·DP1 up to 2 micro-batches" in labels
    assert "variant all TP1·PP1·DP1 up to 4 micro-batches" in labels
    assert len({signature(p.plan) for p in plans}) == len(plans) >= 4
    counts = {p.label: {a.micro_batches for a in p.plan.allocations} for p in plans}
    assert counts["variant all TP1·PP1·DP1 up to 4 micro-batches"] == {4}
