"""A call's candidates as priced (planner/search/mesh_blocks.py): the same-mesh groups and
the C++ core's columns worked out per mesh size equal those read from the candidates
one by one, and the blocks stand for exactly the candidates."""
from __future__ import annotations

import dataclasses

import pytest

from planner.cost.cost_model import CostModel
from planner.graph.algorithms import BatchShape, build_graph
from planner.search import search as search_module
from planner.search.core_bridge import _pack_candidates
from planner.search.mesh_blocks import columns
from planner.search.problem import Problem, RoleModel, assemble, build_problem, head_of
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure


def problem(alg: str, model: str, nodes: int, gpn: int, device: str, split: int | None,
            asynchronous: bool = False) -> Problem:
    roles = {"actor", "critic", "ref", "reward"} if alg == "ppo" else {"actor", "ref"}
    graph = build_graph(alg, BatchShape(prompts_per_step=64, prompt_len=128, gen_len=256,
                                        ppo_minibatches=2),
                        roles, max_staleness=int(asynchronous), asynchronous=asynchronous)
    models = {r: RoleModel(r, model_presets()[model], head_of(r)) for r in roles}
    cluster = ClusterSpec(n_nodes=nodes, gpus_per_node=gpn, device=resolve_device(device))
    return build_problem(graph, models, CostModel(cluster), split=split)


CASES = [("ppo", "llama2-7b", 2, 8, "a100-80g", None, False),
         ("ppo", "llama2-13b", 4, 4, "h100-80g", None, False),
         ("grpo", "llama2-7b", 2, 8, "h100-80g", 8, True)]


@pytest.mark.parametrize("case", CASES)
def test_blocks_stand_for_the_candidates_and_their_groups(case):
    prob = problem(*case)
    assert prob.mesh_blocks
    for cs, blocks in zip(prob.cands, prob.mesh_blocks):
        assert cs == [c.at(f) for priced, firsts in blocks for f in firsts for c in priced]
    plain = assemble(prob.graph, {m.role: m for m in prob.models}, CostModel(prob.cluster),
                     prob.cands, prob.n_iters)
    assert not plain.mesh_blocks
    assert prob.same_mesh == plain.same_mesh
    assert [list(d.items()) for d in prob.on_mesh] == [list(d.items()) for d in plain.on_mesh]
    # one list shared by a mesh's candidates, as the grouping makes it (to_core packs
    # each group once by identity)
    for same in prob.same_mesh:
        assert len({id(g) for g in same}) == len({tuple(g) for g in same})


@pytest.mark.parametrize("case", CASES)
def test_core_columns_per_size_equal_those_per_candidate(case):
    prob = problem(*case)
    cols, groups, group_of = _pack_candidates(prob)
    for i, blocks in enumerate(prob.mesh_blocks):
        c, g, of = columns(blocks)
        assert [list(x) for x in cols[i]] == c
        assert g == groups[i] and of == group_of[i]


@pytest.mark.parametrize("case", CASES)
def test_leanest_start_per_size_is_the_first_leanest_candidate(case):
    prob = problem(*case)
    key = search_module._lean_key
    start = search_module._min_memory_start(prob)
    assert start == [min(range(len(cs)), key=lambda j: key(cs[j])) for cs in prob.cands]
    assert start == search_module._min_memory_start(dataclasses.replace(prob, mesh_blocks=[]))
