"""The polish's restart on equal parts of the cluster joins plans that differ in five
or six calls at once.

A 7B PPO on 4 nodes: from a plan with the trainings on one node each and the scoring
calls on meshes shaped to them, every move of one or two calls and every trade of
meshes between two pairs only makes the plan slower or overflows memory, and the polish
stops at about 11.1 s. The faster plan puts each training on its own half of the
cluster and every other call on the whole of it (about 8.5 s).
"""
from __future__ import annotations

import pytest

import planner.search.polish as polish_mod
from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.graph.algorithms import BatchShape, build_graph
from planner.search.core_bridge import CoreSimulator
from planner.search.problem import Problem, RoleModel, build_problem, head_of
from planner.search.simulator import energy, simulate
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.mesh import enumerate_meshes
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

Mesh = tuple[int, int]


def ppo_4_nodes() -> Problem:
    presets = model_presets()
    cluster = ClusterSpec(n_nodes=4, gpus_per_node=8, device=resolve_device("h100-80g"))
    roles = ("actor", "critic", "ref", "reward")
    models = {r: RoleModel(r, presets["llama2-7b"], head_of(r)) for r in roles}
    graph = build_graph("ppo", BatchShape(prompts_per_step=512, prompt_len=128, gen_len=896,
                                          ppo_minibatches=4), set(roles))
    meshes = [m for m in enumerate_meshes(cluster) if m.n_gpus >= 8]
    return build_problem(graph, models, CostModel(cluster, CostModelConfig()), n_iters=2,
                         meshes=meshes)


def meshes_of(prob: Problem, a: list[int]) -> dict[str, Mesh]:
    return {prob.graph.mfcs[i].name: (prob.cands[i][j].first_gpu, prob.cands[i][j].n_gpus)
            for i, j in enumerate(a)}


def fastest_on(prob: Problem, where: dict[str, Mesh]) -> list[int]:
    """Per MFC its fastest candidate that fits on its mesh in ``where``."""
    out = []
    for i, mfc in enumerate(prob.graph.mfcs):
        cs = prob.cands[i]
        js = [j for j in prob.on_mesh[i][where[mfc.name]]
              if cs[j].resident_bytes + cs[j].activation_bytes <= prob.mem_limit_bytes]
        out.append(min(js, key=lambda j: (cs[j].time_s, j)))
    return out


TRAP = {"actor.generate": (8, 8), "reward.inference": (0, 8), "ref.inference": (16, 8),
        "critic.inference": (0, 16), "actor.train": (16, 8), "critic.train": (24, 8)}


def trap_start(prob: Problem, sim: CoreSimulator) -> list[int]:
    """Every call on its mesh in :data:`TRAP`, stepped down its time/memory front until
    the plan fits."""
    names = [m.name for m in prob.graph.mfcs]
    start, e = polish_mod._fitted(prob, sim, polish_mod._Fronts(prob), fastest_on(prob, TRAP),
                                  {names.index(n): m for n, m in TRAP.items()})
    assert e < float("inf") and meshes_of(prob, start) == TRAP
    return start


def test_the_restart_on_halves_leaves_the_trap():
    prob = ppo_4_nodes()
    sim = CoreSimulator(prob)
    a, e = polish_mod.polish(prob, sim, trap_start(prob, sim))
    res = simulate(prob, a)
    assert res.feasible and energy(prob, res) == pytest.approx(e, rel=1e-9)
    where = meshes_of(prob, a)
    assert sorted([where["actor.train"], where["critic.train"]]) == [(0, 16), (16, 16)]
    assert res.iter_time_s < 9.0
    assert polish_mod.polish(prob, sim, a) == (a, e)      # a fixed point


def test_without_the_restart_the_polish_stops_short(monkeypatch):
    prob = ppo_4_nodes()
    sim = CoreSimulator(prob)
    start = trap_start(prob, sim)
    full = polish_mod.polish(prob, sim, start)[1]
    monkeypatch.setattr(polish_mod, "_best_parts", lambda prob, sim, fronts, a, e: (a, e))
    a, e = polish_mod.polish(prob, sim, start)
    assert e > full * 1.2
    assert simulate(prob, a).iter_time_s > 10.0


def test_part_moves_put_every_training_on_one_part():
    prob = ppo_4_nodes()
    n = prob.cluster.n_gpus
    train = [i for i, t in enumerate(prob.mfc_is_train) if t]
    moves = polish_mod._part_moves(prob, fastest_on(prob, TRAP))
    assert len(moves) == len({tuple(sorted(m.items())) for m in moves})
    for k in polish_mod.PARTS:
        parts = {(p * n // k, n // k) for p in range(k)}
        assert any(all(m[i] in parts for i in train) for m in moves)
    halves = [m for m in moves if {m[i] for i in train} == {(0, n // 2), (n // 2, n // 2)}]
    # the other calls kept, on the whole cluster, or with their model's training
    assert len(halves) == 2 * 3
