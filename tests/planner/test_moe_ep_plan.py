"""Expert parallelism as a layout dimension in the planner: Layout.ep's validity (one rule
with the runtime's), the experts' memory divided by ep (the dense parts not), the token
exchange's all-to-all bytes and time, the search choosing ep (and the C++ core agreeing
on MoE problems), and the reallocation across EP at the byte lower bound."""
from __future__ import annotations

import random

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.memory import optimizer_shard_params, stage_params
from planner.cost.moe_terms import ep_exchange_bytes, experts_hit, local_experts_hit
from planner.cost.rates import Rates
from planner.cost.realloc_cost import ReallocModel, realloc_recv_send, realloc_time
from planner.errors import PlanError
from planner.graph.algorithms import BatchShape, build_graph
from planner.search.anneal import AnnealSettings, anneal
from planner.search.core_bridge import core_anneal, core_simulate, load_core, to_core
from planner.search.problem import RoleModel, build_problem, head_of
from planner.search.simulator import simulate
from planner.specs.cluster import ClusterSpec, DeviceSpec, resolve_device
from planner.specs.layout import Allocation, Layout, check_allocation, enumerate_layouts
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec, MoeSpec, model_presets

pytestmark = pytest.mark.pure

#: 4 layers, h 64, 4 heads of 16, 2 KV heads; 8 experts of 32, top 2 (dense MLP 128)
MOE = ModelSpec(name="toy-moe", family="qwen3_moe", n_layers=4, hidden=64, n_heads=4,
                n_kv_heads=2, ffn_hidden=128, vocab_size=128, qk_norm=True,
                moe=MoeSpec(n_experts=8, top_k=2, expert_ffn_hidden=32))
DENSE = ModelSpec(name="toy", family="qwen3", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2,
                  ffn_hidden=128, vocab_size=128, qk_norm=True)


def _grpo(prompts: int = 8, samples: int = 4, gen: int = 64):
    return build_graph("grpo", BatchShape(prompts_per_step=prompts, samples_per_prompt=samples,
                                          prompt_len=32, gen_len=gen), {"actor"})


# ---- the field and its rule ---------------------------------------------------------

def test_layout_ep_defaults_to_1_and_shows_only_above_1():
    assert Layout(tp=2, dp=4).ep == 1 and str(Layout(tp=2, dp=4)) == "TP2·PP1·DP4"
    assert str(Layout(tp=2, dp=4, ep=2)) == "TP2·PP1·DP4·EP2"


@pytest.mark.parametrize("model, ep, dp, words", [
    (MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"n_experts": 12})}), 8, 8,
     "ep=8 must divide the 12 experts"),
    (MOE, 4, 2, "ep=4 must divide dp=2"),
    (DENSE, 2, 2, "needs a model with experts"),
])
def test_invalid_ep_is_refused_naming_the_field(model, ep, dp, words):
    graph = _grpo(prompts=16)
    train = next(m for m in graph.mfcs if m.kind == "train")
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g"))
    alloc = Allocation(mesh=DeviceMesh(first_gpu=0, n_gpus=dp),
                       layout=Layout(dp=dp, ep=ep))
    with pytest.raises(PlanError, match=words) as e:
        check_allocation(alloc, model, train, cluster, field="plan.manual.actor_train")
    assert e.value.field == "plan.manual.actor_train"


def test_enumerated_layouts_offer_ep_only_for_experts_and_up_to_max_ep():
    graph = _grpo()
    gen = graph.mfcs[0]
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g"))
    mesh = DeviceMesh(first_gpu=0, n_gpus=8)
    moe = enumerate_layouts(mesh, MOE, gen, cluster)
    assert {lay.ep for lay in moe if lay.dp == 8} == {1, 2, 4, 8}
    assert all(lay.dp % lay.ep == 0 for lay in moe)
    assert {lay.ep for lay in enumerate_layouts(mesh, DENSE, gen, cluster)} == {1}
    assert {lay.ep for lay in enumerate_layouts(mesh, MOE, gen, cluster, max_ep=2)} == {1, 2}


# ---- memory ---------------------------------------------------------------------------

def test_ep_divides_the_experts_memory_and_not_the_dense_parts():
    experts = MOE.n_layers * MOE.moe.n_experts * MOE.moe.expert_params(MOE.hidden)
    for tp in (1, 2):
        one = stage_params(MOE, "lm", Layout(tp=tp, dp=4))
        for ep in (2, 4):
            got = stage_params(MOE, "lm", Layout(tp=tp, dp=4, ep=ep))
            # exactly the experts' (1 - 1/ep) share of this GPU's TP shard is gone
            assert got == pytest.approx(one - experts / tp * (1 - 1 / ep))
    assert stage_params(DENSE, "lm", Layout(dp=4)) == stage_params(DENSE, "lm", Layout(dp=4))
    # weights and gradients fall with ep; the distributed optimizer's shard stays 1/dp
    lay1, lay4 = Layout(dp=4), Layout(dp=4, ep=4)
    p1, p4 = stage_params(MOE, "lm", lay1), stage_params(MOE, "lm", lay4)
    assert optimizer_shard_params(MOE, lay4, p4, True) == pytest.approx(p1 / 4)
    assert optimizer_shard_params(MOE, lay4, p4, False) == p4


def test_mfc_memory_of_a_train_call_falls_by_the_experts_share():
    graph = _grpo()
    train = next(m for m in graph.mfcs if m.kind == "train")
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g"))
    cm = CostModel(cluster, CostModelConfig(distributed_optimizer=False))
    mesh = DeviceMesh(first_gpu=0, n_gpus=4)
    c1 = cm.mfc_cost(train, MOE, "lm", mesh, Layout(dp=4), 1)
    c2 = cm.mfc_cost(train, MOE, "lm", mesh, Layout(dp=4, ep=2), 1)
    experts = MOE.n_layers * MOE.moe.n_experts * MOE.moe.expert_params(MOE.hidden)
    cfg = cm.config
    per_param = (cfg.param_dtype_bytes + cfg.grad_dtype_bytes
                 + cfg.optimizer_state_bytes_per_param)
    assert c1.resident_bytes - c2.resident_bytes == pytest.approx(experts / 2 * per_param)
    assert c1.weights_bytes - c2.weights_bytes == pytest.approx(
        experts / 2 * cfg.param_dtype_bytes)


# ---- the token exchange ---------------------------------------------------------------

def test_all_to_all_bytes_on_a_worked_example():
    # 4096 tokens x top 8 x hidden 2048 x bf16 x 7/8 (ep 8)
    q = model_presets()["qwen3-30b-a3b"]
    assert ep_exchange_bytes(q, 4096, 8, 2) == 4096 * 8 * 2048 * 2 * 7 / 8 == 117_440_512
    assert ep_exchange_bytes(q, 4096, 1, 2) == 0.0 and ep_exchange_bytes(DENSE, 9, 4, 2) == 0.0


def test_all_to_all_time_on_nvlink_and_across_nodes():
    dev = DeviceSpec(name="toy", peak_flops=1e12, mem_bytes=1e9, mem_bw_bytes_per_s=1e12,
                     intra_node_bytes_per_s=1e11, inter_node_bytes_per_s=1e10,
                     intra_node_latency_s=1e-6, inter_node_latency_s=1e-5,
                     all_to_all_intra_efficiency=0.5, all_to_all_inter_efficiency=0.5)
    r = Rates(ClusterSpec(n_nodes=2, gpus_per_node=4, device=dev), CostModelConfig())
    # one node, 4 ranks: 3/4 of 8 MB at 5e10 B/s, plus one intra-node latency
    assert r.all_to_all_s(8e6, 4, 1) == pytest.approx(0.75 * 8e6 / 5e10 + 1e-6)
    # 8 ranks over 2 nodes: 7/8 sent, 4 of 7 peers on the other node, at 5e9 B/s
    sent = 7 / 8 * 8e6
    assert r.all_to_all_s(8e6, 8, 2) == pytest.approx(
        max(sent * 3 / 7 / 5e10, sent * 4 / 7 / 5e9) + 1e-5)
    assert r.all_to_all_s(8e6, 1, 1) == 0.0


def test_a_pass_prices_two_all_to_alls_per_sparse_layer_four_in_training():
    from planner.cost.engine_terms import stage_pass
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g"))
    r = CostModel(cluster).rates
    a2a = r.all_to_all_s(512 * 2 * 64 * r.dtype_bytes, 4, 1)
    for kind, n in (("inference", 2), ("train", 4), ("prefill", 2), ("decode", 2)):
        w = stage_pass(r, MOE, "lm", kind, 512, 64, 512, 1, 4, True, True, ep=4)
        assert w.seconds["ep_comm"] == pytest.approx(MOE.n_layers * n * a2a)
        plain = stage_pass(r, MOE, "lm", kind, 512, 64, 512, 1, 4, True, True)
        assert "ep_comm" not in plain.seconds
        # one collective count per all-to-all (the engine's fixed cost per collective)
        assert w.counts["collective_s"] - plain.counts["collective_s"] == MOE.n_layers * n


def test_each_ep_rank_runs_its_experts_on_the_tokens_routed_to_them():
    # the group's ep x rows tokens touch the rank's E/ep experts; at ep 1 the same hit
    assert local_experts_hit(128, 8, 16, 1) == pytest.approx(experts_hit(128, 8, 16))
    assert local_experts_hit(128, 8, 1, 4) == pytest.approx(32 * (1 - (15 / 16) ** 4))
    assert local_experts_hit(128, 8, 4096, 8) == pytest.approx(16.0)


# ---- the search -----------------------------------------------------------------------

def _actor_problem(model: ModelSpec, cluster: ClusterSpec, config: CostModelConfig,
                   graph=None):
    graph = graph or _grpo()
    return build_problem(graph, {"actor": RoleModel("actor", model, "lm")},
                         CostModel(cluster, config))


def test_search_picks_ep_above_1_when_memory_forces_it_and_ep_1_for_dense():
    """Qwen3-30B-A3B GRPO on one node of 8 H100: its train call fits only with the experts
    split (ep > 1: 72 GiB at TP1·DP8·EP8, 86 GiB at best without); with max_ep 1 the plan
    is slower or has no plan at all; a dense model gets ep 1 everywhere."""
    from planner.search.search import SearchSettings, search
    q = model_presets()["qwen3-30b-a3b"]
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g"))
    graph = _grpo(prompts=4, samples=4, gen=128)
    settings = SearchSettings(time_limit_s=120, anneal_steps=20_000)
    models = {"actor": RoleModel("actor", q, "lm")}
    plan = search("ep", graph, models, cluster, settings=settings)
    train = next(a for a in plan.allocations if a.kind == "train")
    assert train.layout.ep > 1, str(train.layout)
    try:
        off = search("ep1", graph, models, cluster, CostModelConfig(max_ep=1),
                     settings=settings)
    except PlanError:
        off = None
    assert off is None or off.iteration_time_s > plan.iteration_time_s
    dense = model_presets()["qwen3-1.7b"]
    plan = search("dense", graph, {"actor": RoleModel("actor", dense, "lm")}, cluster,
                  settings=settings)
    assert all(a.layout.ep == 1 for a in plan.allocations)


def test_python_and_cpp_agree_on_moe_problems():
    rng = random.Random(7)
    n_ep_realloc = 0
    for _ in range(6):
        cluster = ClusterSpec(n_nodes=rng.choice((1, 2)), gpus_per_node=rng.choice((4, 8)),
                              device=resolve_device(rng.choice(("h100-80g", "a100-80g"))))
        graph = _grpo(prompts=rng.choice((4, 8, 16)), samples=rng.choice((2, 4)))
        models = {r: RoleModel(r, MOE, head_of(r)) for r in graph.roles()}
        prob = build_problem(graph, models, CostModel(cluster))
        assert any(c.ep > 1 for cs in prob.cands for c in cs)
        cp = to_core(prob)
        core = load_core()
        for _ in range(40):
            assign = [rng.randrange(len(cs)) for cs in prob.cands]
            py, cc = simulate(prob, assign), core_simulate(prob, assign, cp)
            assert (cc.iter_time_s, cc.makespan_s, cc.overflow_bytes, list(cc.peak_bytes)) == (
                py.iter_time_s, py.makespan_s, py.overflow_bytes, list(py.peak_bytes))
        settings = AnnealSettings(n_steps=400, t0_frac=0.2, t1_frac=1e-3, restart_every=97,
                                  seed=rng.randrange(2**64))
        start = [rng.randrange(len(cs)) for cs in prob.cands]
        py_a, cc_a = anneal(prob, start, settings), core_anneal(prob, start, settings,
                                                                core_prob=cp)
        assert (cc_a.assign, cc_a.energy, cc_a.feasible, cc_a.steps, cc_a.accepted) == (
            py_a.assign, py_a.energy, py_a.feasible, py_a.steps, py_a.accepted)
        for model, rm in enumerate(prob.realloc_models):
            cands = [c for i, cs in enumerate(prob.cands) if prob.mfc_model[i] == model
                     for c in cs]
            for _ in range(60):
                src, dst = rng.choice(cands).place, rng.choice(cands).place
                py_t = realloc_time(rm, src, dst, prob.links)
                assert core.realloc_time(cp, model, src, dst) == py_t, (src, dst)
                n_ep_realloc += src[5] != dst[5]
    assert n_ep_realloc > 50


# ---- reallocation across EP -----------------------------------------------------------

def _held(place, n_experts: int, layer: int, n_layers: int) -> dict[int, set]:
    """Brute force: per GPU of ``place`` holding ``layer``, its (expert, tp shard) pieces."""
    first, n, tp, pp, dp, ep = place
    out: dict[int, set] = {}
    for r in range(n):
        t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
        if not (p * (n_layers // pp) <= layer < (p + 1) * (n_layers // pp)):
            continue
        e = d % ep
        per = n_experts // ep
        out[first + r] = {(x, t) for x in range(e * per, (e + 1) * per)}
    return out


def test_realloc_bytes_across_ep_equal_a_brute_force_count():
    """Experts only (no dense tensors): each destination GPU receives exactly the expert
    bytes it needs and does not hold, counted piece by piece."""
    n_experts, per_expert = 8, 96          # bytes of one expert (divisible by tp 1, 2, 4)
    rm = ReallocModel(n_layers=2, layer_sharded_bytes=0, layer_replicated_bytes=0,
                      embedding_bytes=0, final_norm_bytes=0, head_kind=2, head_bytes=0,
                      layer_expert_bytes=n_experts * per_expert)
    cases = [((0, 4, 1, 1, 4, 1), (0, 4, 1, 1, 4, 2)),
             ((0, 4, 1, 1, 4, 4), (0, 4, 1, 1, 4, 2)),
             ((0, 8, 2, 1, 4, 2), (0, 8, 1, 2, 4, 4)),
             ((0, 4, 2, 1, 2, 2), (4, 4, 1, 1, 4, 4)),
             ((0, 8, 1, 2, 4, 4), (2, 4, 4, 1, 1, 1))]
    for src, dst in cases:
        acc = realloc_recv_send(rm, src, dst, gpn=4)
        want: dict[int, float] = {}
        for layer in range(rm.n_layers):
            s_held = _held(src, n_experts, layer, 2)
            d_held = _held(dst, n_experts, layer, 2)
            tp_s, tp_d = src[2], dst[2]
            for g, pieces in d_held.items():
                mine = s_held.get(g, set())
                for x, t in pieces:
                    # the destination's shard t of tp_d, cut at the source's tp_s shards
                    for k in range(tp_s):
                        lo, hi = max(t * tp_s, k * tp_d), min((t + 1) * tp_s, (k + 1) * tp_d)
                        if hi <= lo or (x, k) in mine:
                            continue
                        want[g] = want.get(g, 0) + per_expert * (hi - lo) / (tp_s * tp_d)
        got = {g: sum(v) for g, v in acc.recv.items() if sum(v)}
        assert got == pytest.approx(want), (src, dst)
    # EP1 -> EP2 on the same GPUs: every GPU held every expert, nothing crosses the wire;
    # EP4 -> EP2 (dp rank d: experts of EP rank d % 4, then d % 2): dp ranks 0 and 3 held
    # 2 of their 4 new experts, ranks 1 and 2 none; 12 experts x 96 bytes x 2 layers
    assert realloc_time(rm, cases[0][0], cases[0][1], _links())[1] == 0
    assert realloc_time(rm, cases[1][0], cases[1][1], _links())[1] == 12 * 96 * 2


def _links():
    from planner.cost.realloc_cost import Links
    return Links(4, 1e11, 1e10, 1e-6, 1e-5)
