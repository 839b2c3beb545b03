"""vLLM's generation in the planner: continuous batching against waves, the engine
choice per generate call, and what the plan, its table and its picture say."""
from __future__ import annotations

import json

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.vllm_cost import concurrency, decode_schedule, kv_bytes_per_seq
from planner.errors import PlanError
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.dataflow import MFC
from planner.graph.lengths import GenLengths
from planner.plan import ExecutionPlan
from planner.report import summary, table
from planner.search.manual import manual_plan
from planner.search.problem import RoleModel, head_of
from planner.search.search import SearchSettings, search
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Allocation, Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec, model_presets
from planner.timeline_svg import render

pytestmark = pytest.mark.pure

FAST = SearchSettings(time_limit_s=2.0, anneal_steps=5000)
SMALL = ModelSpec(name="small", n_layers=4, hidden=256, n_heads=8, n_kv_heads=4,
                  ffn_hidden=768, vocab_size=128)


def gen(n=64, prompt=8, cap=64, lengths=None) -> MFC:
    return MFC(name="actor.generate", role="actor", kind="generate", n_seqs=n,
               prompt_len=prompt, gen_len=cap, input_keys=("prompts",),
               output_keys=("seqs", "logprobs"), lengths=lengths)


def test_kv_bytes_per_sequence_by_hand():
    # 4 layers x (K and V) x 4 KV heads x 32 channels x 4 bytes x 16 positions (12 -> 16)
    assert kv_bytes_per_seq(SMALL, gen(prompt=8, cap=4), 4, 16) == 4 * 2 * 4 * 32 * 4 * 16


def test_decode_schedule_continuous_batching():
    m = gen(cap=4)
    assert decode_schedule(m, 8, 2) == (6 * 4 / 2 + 4 - 1, 8 * 3)
    assert decode_schedule(m, 8, 8) == (3, 24)
    # a long tail: the longest of 64 sets the steps, the mean the sequence-steps
    tail = gen(cap=256, lengths=GenLengths(max_len=256, mean=32))
    steps, seq_steps = decode_schedule(tail, 64, 256)
    assert 3 * 31 < steps <= 255 and seq_steps == pytest.approx(64 * 31, rel=1e-6)


def test_concurrency_is_bounded_by_the_kv_cache_and_max_num_seqs():
    m = gen(prompt=8, cap=4)
    per = kv_bytes_per_seq(SMALL, m, 4, 16)
    cost = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("cpu")),
                     CostModelConfig(param_dtype_bytes=4, vllm_kv_cache_bytes=10 * per,
                                     vllm_max_num_seqs=256))
    assert concurrency(cost, SMALL, m) == 10
    cost = CostModel(cost.cluster, cost.config.model_copy(update={"vllm_max_num_seqs": 3}))
    assert concurrency(cost, SMALL, m) == 3
    cost = CostModel(cost.cluster, cost.config.model_copy(update={"vllm_kv_cache_bytes": per / 2}))
    assert concurrency(cost, SMALL, m) == 0


def cost_model(engine="auto") -> CostModel:
    return CostModel(ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("cpu")),
                     CostModelConfig(param_dtype_bytes=4, generate_engine=engine))


def time_of(cost, mfc, engine, waves=1, dp=2):
    return cost.mfc_cost(mfc, SMALL, "lm", DeviceMesh(first_gpu=0, n_gpus=dp),
                         Layout(tp=1, pp=1, dp=dp), waves, engine=engine).time_s


def test_a_long_tail_costs_waves_more_than_continuous_batching():
    """Same mean tokens: every response at 32, or a censored geometric of mean 32 capped
    at 256. Waves decode to the longest row of each wave, vLLM stops each sequence at its
    own end, so the tail raises the waves' price far more than vLLM's."""
    cost = cost_model()
    fixed = gen(cap=32)
    tail = gen(cap=256, lengths=GenLengths(max_len=256, mean=32))
    own_ratio = time_of(cost, tail, "own", waves=4) / time_of(cost, fixed, "own", waves=4)
    vllm_ratio = time_of(cost, tail, "vllm") / time_of(cost, fixed, "vllm")
    assert own_ratio > 2.0
    assert vllm_ratio < own_ratio / 1.5


def test_vllm_charges_the_weight_copy_and_its_kv_cache():
    cost = cost_model()
    c = cost.mfc_cost(gen(), SMALL, "lm", DeviceMesh(first_gpu=0, n_gpus=2),
                      Layout(tp=1, pp=1, dp=2), 1, engine="vllm")
    weights = 4 * cost.stage_params(SMALL, "lm", Layout(tp=1, pp=1, dp=2))
    # in memory: packed into the bucket, copied out of it, loaded
    assert c.terms_s["weight_load"] == pytest.approx(3 * weights / cost.rates.mem_bytes_per_s)
    from planner.cost.profile import ProfileTable, TransferCosts
    measured = CostModel(cost.cluster, cost.config, ProfileTable(
        device="cpu", vllm_load=TransferCosts(fixed_s=0.01, bytes_per_s=1e9)))
    c = measured.mfc_cost(gen(), SMALL, "lm", DeviceMesh(first_gpu=0, n_gpus=2),
                          Layout(tp=1, pp=1, dp=2), 1, engine="vllm")
    assert c.terms_s["weight_load"] == pytest.approx(0.01 + weights / 1e9)
    assert c.activation_bytes >= weights + cost.config.vllm_kv_cache_bytes


def test_engine_options_follow_the_setting_and_the_layout():
    m = gen()
    one = Layout(tp=1, pp=1, dp=2)
    assert cost_model("own").engine_options(m, one, 1) == ("own",)
    assert cost_model("vllm").engine_options(m, one, 1) == ("vllm",)
    assert cost_model("auto").engine_options(m, one, 1) == ("own", "vllm")
    assert cost_model("auto").engine_options(m, one, 2) == ("own",)          # waves: own only
    assert cost_model("vllm").engine_options(m, Layout(tp=2, pp=1, dp=1), 1) == ("vllm",)
    assert cost_model("vllm").engine_options(m, Layout(tp=1, pp=2, dp=1), 1) == ()
    train = MFC(name="actor.train", role="actor", kind="train", n_seqs=8, prompt_len=8,
                gen_len=8, input_keys=("seqs",), output_keys=("trained",))
    assert cost_model("vllm").engine_options(train, one, 1) == ("own",)


def test_vllm_at_tp2_gathers_the_whole_weights_and_splits_its_kv_cache():
    """At TP 2 one engine spans the two GPUs: its weight update gathers the whole
    tensors over the TP group before the three passes, each GPU holds half the KV heads
    (so twice the sequences fit), and the decode pays the TP all-reduces."""
    cost = cost_model("vllm")
    m = gen(prompt=8, cap=4)
    assert kv_bytes_per_seq(SMALL, m, 4, 16, tp=2) == kv_bytes_per_seq(SMALL, m, 4, 16) / 2
    assert kv_bytes_per_seq(SMALL, m, 4, 16, tp=8) == kv_bytes_per_seq(SMALL, m, 4, 16) / 4
    small = cost.config.model_copy(update={"vllm_kv_cache_bytes": 3 * kv_bytes_per_seq(
        SMALL, m, 4, 16)})
    assert concurrency(CostModel(cost.cluster, small), SMALL, m, tp=2) == 6
    mesh = DeviceMesh(first_gpu=0, n_gpus=2)
    c2 = cost.mfc_cost(gen(), SMALL, "lm", mesh, Layout(tp=2, pp=1, dp=1), 1, engine="vllm")
    whole = 4 * cost.stage_params(SMALL, "lm", Layout(tp=1, pp=1, dp=1))
    gather = cost.rates.collective_s("all_gather", whole, 2, 1)
    assert gather > 0
    assert c2.terms_s["weight_load"] == pytest.approx(
        gather + 3 * whole / cost.rates.mem_bytes_per_s)
    assert c2.weights_bytes == pytest.approx(whole / 2, rel=0.05)   # half on each GPU


def test_the_weight_update_is_priced_device_to_device_on_a_gpu():
    """GPU presets: the bucket is a GPU buffer (CUDA IPC), so the update runs at HBM
    bandwidth, far below the file route's device-host-file round trip."""
    spec = model_presets()["llama3-8b"]
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g"))
    cost = CostModel(cluster, CostModelConfig(generate_engine="vllm"))
    m = gen(n=64, prompt=512, cap=512)
    c = cost.mfc_cost(m, spec, "lm", DeviceMesh(first_gpu=0, n_gpus=2),
                      Layout(tp=2, pp=1, dp=1), 1, engine="vllm")
    whole = 2 * cost.stage_params(spec, "lm", Layout(tp=1, pp=1, dp=1))
    mem = cost.rates.mem_bytes_per_s
    assert c.terms_s["weight_load"] == pytest.approx(
        cost.rates.collective_s("all_gather", whole, 2, 1) + 3 * whole / mem)
    assert c.terms_s["weight_load"] < whole / cluster.device.host_link_bytes_per_s


def grpo(engine, gpn=2, shape=None, model="tiny-llama"):
    shape = shape or BatchShape(prompts_per_step=16, samples_per_prompt=4, prompt_len=8,
                                gen_len=64, gen_len_mean=8, ppo_minibatches=1)
    spec = model_presets()[model]
    models = {"actor": RoleModel("actor", spec, head_of("actor"))}
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=gpn, device=resolve_device("cpu"))
    graph = build_graph("grpo", shape, {"actor"}, score_rollout=engine != "own")
    cfg = CostModelConfig(param_dtype_bytes=4, distributed_optimizer=False,
                          generate_engine=engine)
    return graph, models, cluster, cfg


def test_auto_prices_both_and_the_plan_says_which_engine_generates():
    graph, models, cluster, cfg = grpo("auto")
    plan = search("grpo-auto", graph, models, cluster, cfg, settings=FAST)
    own = search("grpo-own", graph, models, cluster, cfg.model_copy(
        update={"generate_engine": "own"}), settings=FAST)
    vllm = search("grpo-vllm", graph, models, cluster, cfg.model_copy(
        update={"generate_engine": "vllm"}), settings=FAST)
    assert plan.iteration_time_s <= min(own.iteration_time_s, vllm.iteration_time_s) + 1e-12
    assert own.allocation("actor.generate").engine == "own"
    assert vllm.allocation("actor.generate").engine == "vllm"
    gen_alloc = vllm.allocation("actor.generate")
    assert (gen_alloc.layout.tp, gen_alloc.layout.pp, gen_alloc.micro_batches) == (1, 1, 1)
    # the plan says it: JSON (round trip), table, --json summary, picture
    again = ExecutionPlan.from_json(vllm.to_json())
    assert again == vllm and again.allocation("actor.generate").engine == "vllm"
    assert json.loads(vllm.to_json())["allocations"][0]["engine"] == "vllm"
    rows = {line.split()[0]: line.split() for line in table(vllm).splitlines()
            if line.startswith("actor.")}
    assert "vllm" in rows["actor.generate"] and "-" in rows["actor.train"]
    assert {m["name"]: m["engine"] for m in summary(vllm)["mfcs"]}["actor.generate"] == "vllm"
    assert "actor.generate [vllm]" in render(vllm)
    assert "actor.generate [own]" in render(own)


def test_a_vllm_plan_is_refused_where_the_call_is_not_a_generate_call_at_pp1():
    graph, models, cluster, cfg = grpo("vllm")
    plan = search("g", graph, models, cluster, cfg, settings=FAST)
    raw = json.loads(plan.to_json())
    for a in raw["allocations"]:
        if a["mfc"] == "actor.train":
            a["engine"] = "vllm"
    with pytest.raises(PlanError, match="engine vllm runs generate calls"):
        ExecutionPlan.from_json(json.dumps(raw))
    allocs = {a.mfc: Allocation(mesh=a.mesh, layout=a.layout, micro_batches=a.micro_batches)
              for a in plan.allocations}
    allocs["actor.generate"] = Allocation(mesh=DeviceMesh(first_gpu=0, n_gpus=2),
                                          layout=Layout(tp=1, pp=2, dp=1))
    with pytest.raises(PlanError, match="give it pp 1") as e:
        manual_plan("g", graph, models, cluster, allocs, cfg)
    assert e.value.field == "plan.manual.actor.generate"


def test_a_kv_cache_that_holds_no_sequence_leaves_vllm_no_plan():
    graph, models, cluster, cfg = grpo("vllm")
    cfg = cfg.model_copy(update={"vllm_kv_cache_bytes": 1024.0})
    with pytest.raises(PlanError, match="on vLLM .* set rollout.engine to own or auto"):
        search("g", graph, models, cluster, cfg, settings=FAST)


def test_the_rollout_is_scored_by_the_training_forward_when_vllm_may_generate():
    shape = BatchShape(prompts_per_step=4, samples_per_prompt=2, prompt_len=8, gen_len=8,
                       ppo_minibatches=1)
    plain = build_graph("grpo", shape, {"actor"})
    scored = build_graph("grpo", shape, {"actor"}, score_rollout=True)
    assert [m.name for m in plain.mfcs] == ["actor.generate", "actor.train"]
    assert [m.name for m in scored.mfcs] == ["actor.generate", "actor.prox_inference",
                                            "actor.train"]
    assert "prox_logprobs" in scored.mfc("actor.train").input_keys
    assert scored.ahead_steps == 0
    with pytest.raises(PlanError) as e:
        build_graph("dpo", shape, {"actor", "ref"}, score_rollout=True)
    assert e.value.field == "rollout.engine"
