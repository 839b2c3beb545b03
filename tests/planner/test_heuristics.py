"""The hand-written baseline plans: each is the kind of plan its system runs, priced in
the search's own candidate space, and None when it has nothing that fits."""
from __future__ import annotations

import dataclasses

import pytest

from planner.cost.cost_model import CostModel
from planner.graph.algorithms import BatchShape, build_graph
from planner.search.heuristics import (
    HEURISTICS,
    _fit_micro_batches,
    deepspeed_chat,
    megatron,
    not_applicable,
    openrlhf,
    python_sim,
    user_order,
)
from planner.search.problem import Problem, RoleModel, build_problem, head_of
from planner.search.simulator import needs_realloc, simulate
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.mesh import enumerate_meshes
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

PPO = ("ppo", ("actor", "critic", "ref", "reward"))
GRPO = ("grpo", ("actor", "ref"))
GRPO_RM = ("grpo", ("actor", "ref", "reward"))


def problem(alg_roles, model, n_nodes, gpn, prompts=16, meshes=None) -> Problem:
    alg, roles = alg_roles
    presets = model_presets()
    cluster = ClusterSpec(n_nodes=n_nodes, gpus_per_node=gpn, device=resolve_device("a100-80g"))
    shape = BatchShape(prompts_per_step=prompts, prompt_len=64, gen_len=128, ppo_minibatches=2)
    models = {r: RoleModel(r, presets[model], head_of(r)) for r in roles}
    return build_problem(build_graph(alg, shape, set(roles)), models, CostModel(cluster),
                         meshes=meshes)


CASES = [
    (PPO, "tiny-llama", 2, 4),
    (GRPO, "tiny-llama-8l", 1, 4),
    (GRPO_RM, "llama2-7b", 1, 8),
    (PPO, "llama2-7b", 2, 8),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0][0]}-{c[1]}-{c[2]}x{c[3]}")
def prob(request) -> Problem:
    return problem(*request.param)


def chosen(prob: Problem, assign: list[int]):
    return [prob.cands[i][j] for i, j in enumerate(assign)]


def test_megatron_is_symmetric_with_one_layout_per_model(prob):
    assign = megatron(prob)
    assert assign is not None
    cs = chosen(prob, assign)
    assert all((c.first_gpu, c.n_gpus) == (0, prob.n_gpus) for c in cs)
    for model in range(len(prob.models)):
        layouts = {(c.tp, c.pp) for i, c in enumerate(cs) if prob.mfc_model[i] == model}
        assert len(layouts) == 1, prob.models[model].role
    res = simulate(prob, assign)
    assert res.feasible and res.realloc == {}
    assert not any(needs_realloc(prob, assign, i) for i in range(len(assign)))


def check_deepspeed_chat(prob: Problem) -> tuple[int, int]:
    """Checks a deepspeed-chat plan; returns (generation TP, actor training TP)."""
    assign = deepspeed_chat(prob)
    assert assign is not None
    cs = chosen(prob, assign)
    gpn = prob.cluster.gpus_per_node
    assert all((c.first_gpu, c.n_gpus, c.pp) == (0, prob.n_gpus, 1) for c in cs)
    gen = [i for i, m in enumerate(prob.graph.mfcs) if m.kind == "generate"]
    train = prob.graph.mfcs.index(next(m for m in prob.graph.mfcs if m.name == "actor.train"))
    for i in gen:
        # the largest TP inside a node that generation has on all GPUs
        tps = {c.tp for c in prob.cands[i] if (c.first_gpu, c.n_gpus, c.pp) == (0, prob.n_gpus, 1)}
        assert cs[i].tp == max(t for t in tps if t <= gpn)
        assert cs[i].tp >= cs[train].tp
    res = simulate(prob, assign)
    assert res.feasible
    # the actor moves to the generation layout exactly when training uses another TP
    actor = prob.mfc_model[train]
    assert ((actor, gen[0]) in res.realloc) == (cs[gen[0]].tp != cs[train].tp)
    return cs[gen[0]].tp, cs[train].tp


def test_deepspeed_chat_generates_at_intra_node_tp(prob):
    check_deepspeed_chat(prob)


def test_deepspeed_chat_switches_layouts_when_training_fits_at_lower_tp():
    prob = problem(GRPO, "tiny-llama-8l", 1, 4)
    gen_tp, train_tp = check_deepspeed_chat(prob)
    assert (gen_tp, train_tp) == (4, 1)   # 4 KV heads allow TP4; the tiny model trains at TP1


def test_openrlhf_disaggregates_generation_and_training(prob):
    assign = openrlhf(prob)
    assert assign is not None
    cs = chosen(prob, assign)
    meshes = [c.mesh() for c in cs]
    for i, m in enumerate(prob.graph.mfcs):
        for k, n in enumerate(prob.graph.mfcs):
            # pools: two calls share all their GPUs or none
            assert meshes[i] == meshes[k] or not meshes[i].overlaps(meshes[k])
            if m.kind == "generate" and n.kind == "train":
                assert not meshes[i].overlaps(meshes[k]), (m.name, n.name)
    assert simulate(prob, assign).feasible
    # the GPUs are all used: pools split the cluster
    used = {g for mesh in meshes for g in mesh.gpus}
    assert used == set(range(prob.n_gpus))


def test_every_heuristic_returns_none_when_nothing_fits(prob):
    starved = dataclasses.replace(prob, mem_limit_bytes=1.0)
    for name, fn in HEURISTICS.items():
        assert fn(starved) is None, name


def test_symmetric_heuristics_need_the_whole_cluster_as_a_mesh():
    meshes = [m for m in enumerate_meshes(ClusterSpec(n_nodes=1, gpus_per_node=4,
                                                      device=resolve_device("a100-80g")))
              if m.n_gpus < 4]
    prob = problem(GRPO, "tiny-llama", 1, 4, meshes=meshes)
    assert megatron(prob) is None and deepspeed_chat(prob) is None
    assert openrlhf(prob) is not None
    # ... and say so, rather than "does not fit in memory"
    for name in ("megatron", "deepspeed-chat"):
        assert "has no layout on all 4" in not_applicable(name, prob)
    assert not_applicable("openrlhf", prob) is None


def test_a_heuristic_that_applies_has_no_reason_even_when_nothing_fits(prob):
    starved = dataclasses.replace(prob, mem_limit_bytes=1.0)
    assert all(not_applicable(name, starved) is None for name in HEURISTICS)


def test_megatron_shards_a_model_that_needs_it():
    """On a memory-bound case (llama2-7b PPO on one node) megatron must shard models
    (TP/PP above 1) to fit, which the tiny case never needs."""
    prob = problem(PPO, "llama2-7b", 1, 8)
    assign = megatron(prob)
    assert assign is not None
    cs = chosen(prob, assign)
    train = next(i for i, m in enumerate(prob.graph.mfcs) if m.name == "actor.train")
    assert cs[train].tp * cs[train].pp > 1
    assert simulate(prob, assign).feasible


def test_a_megatron_user_raises_tp_to_its_largest_before_pipeline_stages():
    assert user_order({(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2), (4, 4)}) == [
        (1, 1), (2, 1), (4, 1), (4, 2), (4, 4)]
    # a pipeline depth whose largest TP is below the others' keeps that TP
    assert user_order({(1, 1), (8, 1), (4, 2), (2, 2)}) == [(1, 1), (8, 1), (4, 2)]


def test_megatron_layouts_follow_the_users_order(prob):
    """Each model's layout is in its user order (no pipeline stages below the largest
    TP), and no layout earlier in that order than the first that fits is kept."""
    assign = megatron(prob)
    cs = chosen(prob, assign)
    for model in range(len(prob.models)):
        mfcs = [i for i in range(len(cs)) if prob.mfc_model[i] == model]
        common = set.intersection(*({(c.tp, c.pp) for c in prob.cands[i]
                                     if (c.first_gpu, c.n_gpus) == (0, prob.n_gpus)}
                                    for i in mfcs))
        assert (cs[mfcs[0]].tp, cs[mfcs[0]].pp) in user_order(common)


@pytest.mark.parametrize("case,layouts", [
    # 4 KV heads: TP up to 4; the tiny model fits at TP1, and of TP1, 2, 4 (the first
    # that fits and the tuning steps after it) TP4 generates fastest
    ((GRPO, "tiny-llama-8l", 1, 4), {"actor": (4, 1), "ref": (1, 1)}),
    # four 7B models on 8 A100-80G: the actor at TP8 (a user's last TP before PP), the
    # critic at TP4, reference and reward, which hold weights only, at TP1
    ((PPO, "llama2-7b", 1, 8), {"actor": (8, 1), "critic": (4, 1), "ref": (1, 1),
                                "reward": (1, 1)}),
])
def test_megatron_by_hand(case, layouts):
    prob = problem(*case)
    cs = chosen(prob, megatron(prob))
    got = {prob.models[prob.mfc_model[i]].role: (c.tp, c.pp) for i, c in enumerate(cs)}
    assert got == layouts
    assert all((c.first_gpu, c.n_gpus) == (0, prob.n_gpus) for c in cs)


def test_deepspeed_chat_trains_at_the_smallest_tp_that_fits():
    """PPO with four 7B models on 8 A100-80G: at every smaller training TP nothing fits
    (the micro-batch fit finds no plan), at the chosen one it does."""
    prob = problem(PPO, "llama2-7b", 1, 8)
    cs = chosen(prob, deepspeed_chat(prob))
    train_tp = next(c.tp for m, c in zip(prob.graph.mfcs, cs) if m.name == "actor.train")
    assert all(c.tp == train_tp for m, c in zip(prob.graph.mfcs, cs) if m.kind != "generate")
    for tp in (t for t in (1, 2, 4, 8) if t < train_tp):
        choice = []
        for i, m in enumerate(prob.graph.mfcs):
            js = [j for j in range(len(prob.cands[i]))
                  if (prob.cands[i][j].first_gpu, prob.cands[i][j].n_gpus,
                      prob.cands[i][j].pp) == (0, 8, 1)]
            gen_tp = cs[i].tp if m.kind == "generate" else tp
            choice.append([j for j in js if prob.cands[i][j].tp == gen_tp] or js)
        assert _fit_micro_batches(prob, choice, None, python_sim(prob)) is None, tp
