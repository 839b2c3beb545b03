"""Reallocating a mixture of experts whose dense-MLP layers sit among sparse ones: the
closed form (:mod:`planner.cost.realloc_cost`, and its C++ twin) prices each layer kind
at its own size, so the bytes it prices equal the transfer plan's
(:func:`planner.cost.transfer.transfer_plan`, what the executor moves and checks the
execution plan against) and a brute-force count over :func:`held_tensors`.

The model is the tiny Qwen3-MoE of the runtime tests (``realign.assets.tiny``'s
``TINY_QWEN3_MOE``): 3 layers, the middle one dense, 8 experts of 32, top 2.
"""
from __future__ import annotations

import random

import pytest

from planner.cost.cost_model import CostModel
from planner.cost.realloc_cost import Links, ReallocModel, realloc_recv_send, realloc_time
from planner.cost.transfer import Placement, held_tensors, transfer_plan
from planner.graph.algorithms import BatchShape, build_graph
from planner.search.core_bridge import load_core, to_core
from planner.search.problem import RoleModel, build_problem, head_of
from planner.search.simulator import simulate
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout, coords_of_rank
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec, MoeSpec

pytestmark = pytest.mark.pure

TINY_MOE = ModelSpec(name="tiny-qwen3-moe", family="qwen3_moe", n_layers=3, hidden=64,
                     n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden=96, vocab_size=64,
                     qk_norm=True, moe=MoeSpec(n_experts=8, top_k=2, expert_ffn_hidden=32,
                                               dense_layers=(1,)))
#: 4 layers at PP2: stage 0 holds a dense and a sparse layer, stage 1 two dense ones
MIXED4 = TINY_MOE.model_copy(update=dict(
    name="mixed4", n_layers=4, moe=MoeSpec(n_experts=8, top_k=2, expert_ffn_hidden=32,
                                           dense_layers=(0, 2, 3))))
LINKS = Links(4, 1e11, 1e10, 1e-6, 1e-5)


def _placement(p: tuple[int, ...]) -> Placement:
    first, n, tp, pp, dp, ep = p
    return Placement(DeviceMesh(first_gpu=first, n_gpus=n), Layout(tp=tp, pp=pp, dp=dp, ep=ep))


def _brute_force(spec: ModelSpec, head: str, src: tuple[int, ...], dst: tuple[int, ...],
                 dtype_bytes: int) -> dict[int, int]:
    """Per destination GPU, the bytes of its held tensors' shards it did not hold at
    ``src``: element by element over the tensors' sharded index ranges."""
    sp, dp_ = _placement(src), _placement(dst)
    src_held: dict[int, dict[str, set[int]]] = {}
    for r in range(sp.mesh.n_gpus):
        k, d, j = coords_of_rank(r, sp.layout)
        for t in held_tensors(spec, head, None, sp.layout, d, j):
            idx = (set(range(t.numel)) if t.shard_dim is None else
                   {x for a, b in t.shard_ranges(k, sp.layout.tp) for x in range(a, b)})
            src_held.setdefault(sp.mesh.first_gpu + r, {})[t.content] = idx
    out: dict[int, int] = {}
    for r in range(dp_.mesh.n_gpus):
        g = dp_.mesh.first_gpu + r
        i, d, j = coords_of_rank(r, dp_.layout)
        for t in held_tensors(spec, head, None, dp_.layout, d, j):
            per = (t.numel // t.shape[t.shard_dim] if t.shard_dim is not None else 1)
            need = (set(range(t.numel)) if t.shard_dim is None else
                    {x for a, b in t.shard_ranges(i, dp_.layout.tp) for x in range(a, b)})
            lack = need - src_held.get(g, {}).get(t.content, set())
            if lack:
                out[g] = out.get(g, 0) + len(lack) * per * dtype_bytes
    return out


CASES = [
    (TINY_MOE, (0, 2, 1, 1, 2, 1), (0, 2, 1, 1, 2, 2)),      # the run's generate -> train
    (TINY_MOE, (0, 2, 1, 1, 2, 2), (0, 2, 1, 1, 2, 1)),
    (TINY_MOE, (0, 4, 2, 1, 2, 2), (0, 4, 1, 1, 4, 4)),
    (TINY_MOE, (0, 4, 1, 1, 4, 4), (4, 2, 2, 1, 1, 1)),
    (TINY_MOE, (0, 2, 2, 1, 1, 1), (2, 4, 1, 1, 4, 2)),
    (MIXED4, (0, 4, 1, 2, 2, 2), (0, 4, 1, 1, 4, 4)),
    (MIXED4, (0, 4, 1, 1, 4, 2), (0, 8, 2, 2, 2, 2)),
    (MIXED4, (0, 8, 2, 2, 2, 1), (0, 4, 1, 2, 2, 2)),
]


@pytest.mark.parametrize("spec,src,dst", CASES)
def test_priced_bytes_equal_the_transfer_plan_and_a_brute_force_count(spec, src, dst):
    dtype_bytes = 4
    rm = ReallocModel.of(spec, "lm", dtype_bytes)
    acc = realloc_recv_send(rm, src, dst, gpn=4)
    priced = {g: sum(v) for g, v in acc.recv.items() if sum(v)}
    plan = transfer_plan(spec, "lm", _placement(src), _placement(dst), 4, dtype_bytes)
    moved: dict[int, int] = {}
    for c in plan.remote:
        moved[c.dst_gpu] = moved.get(c.dst_gpu, 0) + c.nbytes
    assert priced == moved == _brute_force(spec, "lm", src, dst, dtype_bytes), (src, dst)
    assert realloc_time(rm, src, dst, LINKS)[1] == plan.bytes_moved()


def test_the_tiny_moe_generate_to_train_move_is_its_missing_experts():
    """Generation at DP2·EP1 after training at DP2·EP2, on the same 2 GPUs: each GPU
    receives the 4 experts of the other EP rank on each of the 2 sparse layers, 4 x
    (3 x 32 x 64) elements a layer (98,304 elements in all, not 3 layers' 147,456);
    the move back to training receives nothing (each GPU held every expert)."""
    rm = ReallocModel.of(TINY_MOE, "lm", 1)
    assert rm.dense_layers == (1,)
    assert realloc_time(rm, (0, 2, 1, 1, 2, 2), (0, 2, 1, 1, 2, 1), LINKS)[1] == (
        2 * 2 * 4 * 3 * 32 * 64) == 98_304
    assert realloc_time(rm, (0, 2, 1, 1, 2, 1), (0, 2, 1, 1, 2, 2), LINKS)[1] == 0


def test_cpp_twin_agrees_on_mixed_layers():
    rng = random.Random(3)
    cluster = ClusterSpec(n_nodes=2, gpus_per_node=4, device=resolve_device("h100-80g"))
    graph = build_graph("grpo", BatchShape(prompts_per_step=8, samples_per_prompt=4,
                                           prompt_len=32, gen_len=64), {"actor"})
    core = load_core()
    n_dense_stage = 0
    for spec in (TINY_MOE, MIXED4):
        models = {r: RoleModel(r, spec, head_of(r)) for r in graph.roles()}
        prob = build_problem(graph, models, CostModel(cluster))
        cp = to_core(prob)
        for model, rm in enumerate(prob.realloc_models):
            assert rm.dense_layers == spec.moe.dense_layers
            cands = [c for i, cs in enumerate(prob.cands) if prob.mfc_model[i] == model
                     for c in cs]
            for _ in range(150):
                src, dst = rng.choice(cands).place, rng.choice(cands).place
                assert core.realloc_time(cp, model, src, dst) == realloc_time(
                    rm, src, dst, prob.links), (spec.name, src, dst)
                n_dense_stage += spec is MIXED4 and (src[3] == 2 or dst[3] == 2)
    assert n_dense_stage > 20


def test_the_plans_reallocation_bytes_equal_what_the_executor_moves():
    """The run-level check (``realign.realloc.executor.reallocate``'s "the planner and the
    executor disagree"): the execution plan's bytes for the tiny MoE actor's
    generate-at-EP1, train-at-EP2 assignment equal its transfer plan's."""
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("cpu"))
    graph = build_graph("grpo", BatchShape(prompts_per_step=4, samples_per_prompt=2,
                                           prompt_len=8, gen_len=8), {"actor"})
    prob = build_problem(graph, {r: RoleModel(r, TINY_MOE, head_of(r))
                                 for r in graph.roles()}, CostModel(cluster))
    want = {"generate": (0, 2, 1, 1, 2, 1), "train": (0, 2, 1, 1, 2, 2)}
    assign = []
    for m, cs in zip(prob.graph.mfcs, prob.cands):
        place = want.get(m.kind, want["train"])
        assign.append(next(j for j, c in enumerate(cs) if c.place == place))
    res = simulate(prob, assign, record=True)
    assert res.realloc, "the generate call's layout differs from training's"
    for (model, i), (_t, nbytes) in res.realloc.items():
        src = prob.cands[prob.model_train_mfc[model]][assign[prob.model_train_mfc[model]]]
        dst = prob.cands[i][assign[i]]
        dtype_bytes = CostModel(cluster).config.param_dtype_bytes
        plan = transfer_plan(TINY_MOE, prob.models[model].head, _placement(src.place),
                             _placement(dst.place), 2, dtype_bytes)
        assert nbytes == plan.bytes_moved(), (src.place, dst.place)
