"""The simulator on hand-built problems with round numbers: overlap, serialisation,
dependencies, reallocations, iteration time and per-GPU memory; and the prefix
simulation that branch and bound relies on, on random built problems."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from planner.cost.cost_model import CostModel
from planner.cost.realloc_cost import Links, ReallocModel, realloc_time
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.dataflow import MFC, DataflowGraph
from planner.search.problem import (
    Candidate,
    Problem,
    RoleModel,
    build_problem,
    head_of,
)
from planner.search.problem_records import add_records
from planner.search.simulator import OVERFLOW_PENALTY, energy, needs_realloc, simulate
from planner.specs.cluster import ClusterSpec, DeviceSpec, resolve_device
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

TINY = model_presets()["tiny-llama"]
DEV = DeviceSpec(name="toy", peak_flops=1e12, mem_bytes=1e9, mem_bw_bytes_per_s=1e11,
                 intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e8)
LINKS = Links(gpus_per_node=4, intra_bytes_per_s=1e6, inter_bytes_per_s=1e5,
              intra_latency_s=0.0, inter_latency_s=0.0)


def call(name: str, ins=("prompts",), outs=None, kind: str | None = None) -> MFC:
    role, what = name.split(".")
    kind = kind or ("train" if what == "train" else "generate" if what == "generate"
                    else "inference")
    return MFC(name=name, role=role, kind=kind, n_seqs=4, prompt_len=8, gen_len=8,
               input_keys=ins, output_keys=outs or (name + ".out",))


def cand(first, n, time_s, tp=1, pp=1, dp=None, mb=1, resident=0.0, act=0.0, weights=0.0):
    dp = dp if dp is not None else n // (tp * pp)
    return Candidate(first, n, tp, pp, dp, mb, time_s, resident, act, weights)


def problem(mfcs: list[MFC], cands: list[list[Candidate]], n_gpus=4, limit=1e9,
            n_iters=1, send_s=0.0) -> Problem:
    graph = DataflowGraph(algorithm="custom", mfcs=tuple(mfcs))
    roles = graph.roles()
    ridx = {r: k for k, r in enumerate(roles)}
    train = [-1] * len(roles)
    for i, m in enumerate(graph.mfcs):
        if m.kind == "train":
            train[ridx[m.role]] = i
    prob = Problem(
        cluster=ClusterSpec(n_nodes=n_gpus // 4, gpus_per_node=4, device=DEV),
        graph=graph, models=[RoleModel(r, TINY, head_of(r)) for r in roles],
        mem_limit_bytes=limit, links=LINKS, mfc_model=[ridx[m.role] for m in graph.mfcs],
        mfc_is_train=[m.kind == "train" for m in graph.mfcs], deps=graph.deps(),
        model_train_mfc=train,
        realloc_models=[ReallocModel.of(TINY, head_of(r), 2) for r in roles],
        cands=cands, n_iters=n_iters)
    prob.same_mesh = [[[j for j, d in enumerate(cs) if (d.first_gpu, d.n_gpus)
                        == (c.first_gpu, c.n_gpus)] for c in cs] for cs in cands]
    add_records(prob, graph, {r: head_of(r) for r in roles}, lambda size: (send_s, send_s))
    return prob


def starts(res, it=0) -> dict[str, float]:
    return {e.name: e.start_s for e in res.events if e.iteration == it and e.kind != "realloc"}


# ---- scheduling --------------------------------------------------------------------

def test_disjoint_meshes_overlap():
    p = problem([call("a.inference"), call("b.inference")],
                [[cand(0, 2, 3.0)], [cand(2, 2, 5.0)]])
    r = simulate(p, [0, 0], record=True)
    assert r.makespan_s == 5.0 and r.iter_time_s == 5.0
    assert starts(r) == {"a.inference": 0.0, "b.inference": 0.0}


@pytest.mark.parametrize("b_first,b_n", [(0, 4), (2, 2), (1, 1), (0, 2)])
def test_meshes_sharing_a_gpu_serialise(b_first, b_n):
    p = problem([call("a.inference"), call("b.inference")],
                [[cand(0, 4, 3.0)], [cand(b_first, b_n, 5.0)]])
    r = simulate(p, [0, 0], record=True)
    assert r.makespan_s == 8.0
    assert starts(r)["b.inference"] == 3.0


def test_dependencies_are_respected_across_disjoint_meshes():
    p = problem([call("a.inference", outs=("k",)), call("b.inference", ins=("k",))],
                [[cand(0, 2, 3.0)], [cand(2, 2, 5.0)]])
    r = simulate(p, [0, 0], record=True)
    assert r.makespan_s == 8.0 and starts(r)["b.inference"] == 3.0


def test_iterations_do_not_overlap():
    """a(3 s) feeds b(5 s) on disjoint GPUs: iteration k+1's a waits for iteration k's b,
    as the runtime's step barrier makes it (the controller starts step k+1 when every
    worker is done with step k)."""
    p = problem([call("a.inference", outs=("k",)), call("b.inference", ins=("k",))],
                [[cand(0, 2, 3.0)], [cand(2, 2, 5.0)]], n_iters=3)
    r = simulate(p, [0, 0], record=True)
    # a: 0-3, 8-11, 16-19; b: 3-8, 11-16, 19-24
    assert [starts(r, it)["a.inference"] for it in range(3)] == [0.0, 8.0, 16.0]
    assert [starts(r, it)["b.inference"] for it in range(3)] == [3.0, 11.0, 19.0]
    assert r.makespan_s == 24.0 and r.iter_time_s == 8.0


def test_a_record_is_sent_to_the_gpus_that_lack_it():
    """b on GPUs 2-3 reads what a wrote on GPUs 0-1: a Send (2 s) from GPUs 0-1 to 2-3
    occupies all four, then b runs; c on GPUs 0-3 finds the record everywhere by then."""
    p = problem([call("a.inference", outs=("k",)), call("b.inference", ins=("k",)),
                 call("c.inference", ins=("k",))],
                [[cand(0, 2, 3.0)], [cand(2, 2, 5.0)], [cand(0, 4, 1.0)]], send_s=2.0)
    r = simulate(p, [0, 0, 0], record=True)
    sends = [e for e in r.events if e.kind == "send"]
    assert [(e.name, e.start_s, e.end_s, e.gpus) for e in sends] == [
        ("send k", 3.0, 5.0, (0, 1, 2, 3))]
    assert starts(r)["b.inference"] == 5.0 and starts(r)["c.inference"] == 10.0
    assert r.iter_time_s == 11.0


def test_a_send_waits_for_its_sender():
    """The holder of k is busy with x until 10 s: the Send to b's GPU waits for it."""
    p = problem([call("a.inference", outs=("k",)), call("x.inference"),
                 call("b.inference", ins=("k",))],
                [[cand(0, 1, 1.0)], [cand(0, 1, 9.0)], [cand(1, 1, 1.0)]], send_s=0.5)
    r = simulate(p, [0, 0, 0], record=True)
    assert starts(r)["b.inference"] == 10.5 and r.iter_time_s == 11.5


def test_serial_iterations_add_up():
    p = problem([call("a.inference", outs=("k",)), call("b.inference", ins=("k",))],
                [[cand(0, 4, 3.0)], [cand(0, 4, 5.0)]], n_iters=3)
    r = simulate(p, [0, 0])
    assert r.makespan_s == 24.0 and r.iter_time_s == 8.0


# ---- reallocation ------------------------------------------------------------------

GEN_TRAIN = [call("actor.generate", outs=("seqs",)), call("actor.train", ins=("seqs",))]


def rt(src: Candidate, dst: Candidate) -> tuple[float, int]:
    return realloc_time(ReallocModel.of(TINY, "lm", 2), src.place, dst.place, LINKS)


def test_no_reallocation_on_the_training_placement():
    # same mesh, tp and pp; dp and micro-batches may differ (they do not move weights)
    gen, train = cand(0, 4, 2.0, tp=2, mb=2), cand(0, 4, 7.0, tp=2, mb=1)
    p = problem(GEN_TRAIN, [[gen], [train]], n_iters=2)
    r = simulate(p, [0, 0], record=True)
    assert not needs_realloc(p, [0, 0], 0)
    assert r.realloc == {} and not any(e.kind == "realloc" for e in r.events)
    assert r.makespan_s == 18.0
    # the next iteration's generate waits for the previous train (new weights)
    assert starts(r, 1)["actor.generate"] == 9.0


@pytest.mark.parametrize("gen", [
    cand(0, 4, 2.0, tp=4),             # same mesh, another TP
    cand(0, 4, 2.0, tp=1, pp=2),       # same mesh, another PP
    cand(0, 2, 2.0, tp=1, dp=2),       # a smaller mesh, another TP
])
def test_reallocation_when_the_placement_differs(gen):
    train = cand(0, 4, 7.0, tp=2)
    p = problem(GEN_TRAIN, [[gen], [train]], n_iters=2)
    r = simulate(p, [0, 0], record=True)
    assert needs_realloc(p, [0, 0], 0) and not needs_realloc(p, [0, 0], 1)
    r_s, r_bytes = rt(train, gen)
    assert r_s > 0 and r_bytes > 0
    assert r.realloc == {(0, 0): (r_s, r_bytes)}
    reallocs = [e for e in r.events if e.kind == "realloc"]
    assert [e.iteration for e in reallocs] == [0, 1]
    # it occupies both placements' GPUs, and is followed by generate, then train
    assert all(e.gpus == (0, 1, 2, 3) for e in reallocs)
    assert reallocs[0].start_s == 0.0 and reallocs[0].end_s == pytest.approx(r_s)
    assert starts(r, 0)["actor.generate"] == reallocs[0].end_s
    # iteration 1 starts with the reallocation of the weights the train just produced
    train0_end = [e.end_s for e in r.events if e.name == "actor.train" and e.iteration == 0]
    assert reallocs[1].start_s == train0_end[0]
    assert r.makespan_s == pytest.approx(2 * (r_s + 2.0 + 7.0))


def test_a_nested_placement_holding_its_shards_moves_nothing():
    """GPUs 2-3 of a TP2-DP2 training mesh hold a whole TP2 replica already."""
    gen, train = cand(2, 2, 2.0, tp=2), cand(0, 4, 7.0, tp=2)
    p = problem(GEN_TRAIN, [[gen], [train]], n_iters=2)
    r = simulate(p, [0, 0])
    assert needs_realloc(p, [0, 0], 0)
    assert r.realloc == {(0, 0): (0.0, 0)}
    assert r.makespan_s == 18.0


def test_reallocation_occupies_the_source_mesh_too():
    """A frozen ref on the training GPUs must wait for the reallocation out of them."""
    mfcs = [call("actor.generate", outs=("seqs",)), call("ref.inference", ins=("prompts",)),
            call("actor.train", ins=("seqs",))]
    gen, ref, train = cand(2, 2, 2.0), cand(0, 2, 1.0), cand(0, 2, 7.0)
    p = problem(mfcs, [[gen], [ref], [train]])
    r = simulate(p, [0, 0, 0], record=True)
    r_s, _ = rt(train, gen)
    assert starts(r)["ref.inference"] == pytest.approx(r_s)
    assert starts(r)["actor.generate"] == pytest.approx(r_s)


# ---- memory ------------------------------------------------------------------------

def test_frozen_weights_count_once_per_placement():
    mfcs = [call("ref.inference", outs=("k",)), call("ref.score", ins=("k",))]
    same = problem(mfcs, [[cand(0, 2, 1.0, resident=10.0, act=3.0)],
                          [cand(0, 2, 1.0, resident=10.0, act=7.0, mb=2)]])
    assert simulate(same, [0, 0]).peak_bytes == [17.0, 17.0, 0.0, 0.0]
    apart = problem(mfcs, [[cand(0, 2, 1.0, resident=10.0, act=3.0)],
                           [cand(2, 2, 1.0, resident=10.0, act=7.0)]])
    assert simulate(apart, [0, 0]).peak_bytes == [13.0, 13.0, 17.0, 17.0]
    # same GPUs, another layout: two copies of the weights, transients still max
    relaid = problem(mfcs, [[cand(0, 2, 1.0, resident=10.0, act=3.0)],
                            [cand(0, 2, 1.0, tp=2, resident=10.0, act=7.0)]])
    assert simulate(relaid, [0, 0]).peak_bytes == [27.0, 27.0, 0.0, 0.0]


def test_trained_model_memory_and_the_realloc_copy():
    train = cand(0, 2, 7.0, resident=40.0, act=5.0, weights=8.0)
    # elsewhere: no resident state there, but a temporary copy of the weights
    away = problem(GEN_TRAIN, [[cand(2, 2, 1.0, resident=8.0, act=6.0, weights=8.0)], [train]])
    assert simulate(away, [0, 0]).peak_bytes == [45.0, 45.0, 14.0, 14.0]
    # on the training placement: the train's state is there already
    home = problem(GEN_TRAIN, [[cand(0, 2, 1.0, resident=8.0, act=6.0, weights=8.0)], [train]])
    assert simulate(home, [0, 0]).peak_bytes == [46.0, 46.0, 0.0, 0.0]
    # resident memory of several models adds up; transients take the max
    mfcs = GEN_TRAIN + [call("ref.inference", ins=("seqs",))]
    both = problem(mfcs, [[cand(0, 2, 1.0, act=6.0, weights=8.0)], [train],
                          [cand(0, 4, 1.0, resident=3.0, act=9.0)]])
    assert simulate(both, [0, 0, 0]).peak_bytes == [52.0, 52.0, 12.0, 12.0]


@pytest.mark.parametrize("limit,overflow", [(44.0, 1.0), (45.0, 0.0), (50.0, 0.0),
                                            (30.0, 15.0)])
def test_overflow_and_feasible(limit, overflow):
    train = cand(0, 2, 7.0, resident=40.0, act=5.0, weights=8.0)
    p = problem(GEN_TRAIN, [[cand(2, 2, 1.0, act=6.0, weights=8.0)], [train]], limit=limit)
    r = simulate(p, [0, 0])
    assert r.overflow_bytes == overflow
    assert r.feasible == (overflow == 0.0)
    assert energy(p, r) == pytest.approx(r.iter_time_s * (1 + OVERFLOW_PENALTY * overflow / limit))


# ---- the prefix simulation is a lower bound ----------------------------------------

def random_built_problem(rng: random.Random) -> Problem:
    presets = model_presets()
    alg, roles = rng.choice([("ppo", {"actor", "critic", "ref", "reward"}),
                             ("grpo", {"actor", "ref", "reward"}), ("grpo", {"actor", "ref"}),
                             ("remax", {"actor", "ref", "reward"}), ("dpo", {"actor", "ref"})])
    n_nodes, gpn = rng.choice([(1, 4), (2, 2), (2, 4), (1, 8)])
    cluster = ClusterSpec(n_nodes=n_nodes, gpus_per_node=gpn, device=resolve_device("a100-80g"))
    shape = BatchShape(prompts_per_step=rng.choice((4, 8)), samples_per_prompt=rng.choice((1, 2)),
                       prompt_len=32, gen_len=rng.choice((32, 128)), ppo_minibatches=2)
    models = {r: RoleModel(r, presets[rng.choice(("tiny-llama", "tiny-qwen", "llama2-7b"))],
                           head_of(r)) for r in roles}
    return build_problem(build_graph(alg, shape, roles), models, CostModel(cluster),
                         n_iters=rng.randint(1, 3))


def test_prefix_simulation_is_a_lower_bound():
    rng = random.Random(5)
    n_checked = n_strict = 0
    for _ in range(12):
        prob = random_built_problem(rng)
        # a limit that some assignments overflow, so memory bounds are exercised too
        prob = replace(prob, mem_limit_bytes=prob.mem_limit_bytes / rng.choice((1, 200, 2000)))
        for _ in range(15):
            assign = [rng.randrange(len(cs)) for cs in prob.cands]
            full = simulate(prob, assign)
            for k in range(1, len(assign)):
                part = simulate(prob, assign, upto=k)
                assert part.makespan_s <= full.makespan_s
                assert part.overflow_bytes <= full.overflow_bytes
                assert all(a <= b for a, b in zip(part.peak_bytes, full.peak_bytes))
                n_checked += 1
                n_strict += part.makespan_s < full.makespan_s
            assert simulate(prob, assign, upto=len(assign)).makespan_s == full.makespan_s
    assert n_checked > 300 and n_strict > 100


def test_a_candidate_moved_to_another_mesh_keeps_every_other_field():
    import dataclasses

    from planner.search.problem import Candidate
    c = Candidate(*[i + 1 for i in range(10)], True, 7.5, True, 0.25, True, "vllm", 2048, 2)
    assert c.at(64) == dataclasses.replace(c, first_gpu=64)
    assert [f.name for f in dataclasses.fields(c)][-1] == "ep"   # at() lists them all
