"""LoRA in the planner: the settings' checks, the adapters' logical tensors and their
sharding, the cost model's memory and time of LoRA training, the reallocation that
moves only adapters (closed form equal to the transfer plan), the simulator keeping
the frozen base resident, and the 70B PPO on 16 A100s planning without offload."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from planner.cost.cost_model import CostModel
from planner.cost.realloc_cost import ReallocModel, realloc_recv_send
from planner.cost.transfer import Placement, transfer_plan
from planner.graph.algorithms import BatchShape, build_graph
from planner.search.problem import RoleModel, build_problem, head_of
from planner.search.simulator import memory
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.lora import LoraSpec, adapter_stage_tensors, trained_stage_tensors
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]
SPEC = model_presets()["llama2-7b"]


# ---- settings ----------------------------------------------------------------------------

def test_targets_accept_megatron_peft_and_all_linear_names():
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert LoraSpec(rank=8).target_modules == every
    assert LoraSpec(rank=8, target_modules=["all-linear"]).target_modules == every
    assert LoraSpec(rank=8).targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    got = LoraSpec(rank=8, target_modules=["down_proj", "linear_qkv"])
    assert got.target_modules == ("q_proj", "k_proj", "v_proj", "down_proj")
    assert got.targets == ("linear_qkv", "linear_fc2")
    assert LoraSpec(rank=8, target_modules="o_proj").targets == ("linear_proj",)
    # any subset of a fused layer's parts, as PEFT adapts them
    qv = LoraSpec(rank=8, target_modules=["v_proj", "q_proj"])
    assert qv.target_modules == ("q_proj", "v_proj") and qv.targets == ("linear_qkv",)
    assert qv.parts("linear_qkv") == ("q_proj", "v_proj")
    assert LoraSpec(rank=8, target_modules=["up_proj"]).parts("linear_fc1") == ("up_proj",)


@pytest.mark.parametrize("fields,field,needle", [
    ({"rank": 0}, "rank", "greater than 0"), ({"rank": -4}, "rank", "greater than 0"),
    ({"rank": 8, "target_modules": ["lm_head"]}, "target_modules", "matches no layer"),
    ({"rank": 8, "target_modules": []}, "target_modules", "no target modules"),
    ({"rank": 8, "dropout": 1.0}, "dropout", "less than 1"),
    ({"rank": 8, "alpha": 0}, "alpha", "greater than 0"),
    ({"rank": 8, "shared_a": "sometimes"}, "shared_a", "valid boolean"),
])
def test_bad_settings_name_the_field(fields, field, needle):
    with pytest.raises(ValidationError) as e:
        LoraSpec(**fields)
    assert needle in str(e.value)
    assert e.value.errors()[0]["loc"] == (field,)


#: PEFT's trainable parameters, LLaMA-2 7B (hidden 4096, ffn 11008, 32 heads = kv
#: heads, 32 layers), rank 16, by hand: per module r * (in + out), times 32 layers
PEFT_7B_R16 = {
    ("all-linear",): 32 * 16 * (4 * (4096 + 4096) + 2 * (4096 + 11008) + (11008 + 4096)),
    ("q_proj", "v_proj"): 32 * 16 * 2 * (4096 + 4096),
    ("k_proj", "gate_proj"): 32 * 16 * ((4096 + 4096) + (4096 + 11008)),
}


@pytest.mark.parametrize("targets", list(PEFT_7B_R16))
def test_trained_parameters_are_pefts(targets):
    """The same count as PEFT for the same target_modules and rank (tests/runtime/
    test_lora_count.py counts PEFT's own models); ``shared_a`` trains fewer: one A of
    each fused layer's parts."""
    lora = LoraSpec(rank=16, target_modules=list(targets))
    assert lora.total_params(SPEC) == PEFT_7B_R16[targets]
    shared = LoraSpec(rank=16, target_modules=list(targets), shared_a=True)
    fused_extra = sum(len(lora.parts(t)) - 1 for t in ("linear_qkv", "linear_fc1")
                      if lora.parts(t))
    assert shared.total_params(SPEC) == PEFT_7B_R16[targets] - 32 * 16 * 4096 * fused_extra


def test_scale_defaults_to_one():
    assert LoraSpec(rank=16).scale == 1.0
    assert LoraSpec(rank=16, alpha=32).scale == 2.0


# ---- tensors -------------------------------------------------------------------------------

def test_adapters_are_split_like_their_base():
    """Column-parallel layers: A whole (the parts' A stacked), B split by output (fc1
    part by part, like its base); row-parallel ones: A split by input, B whole."""
    ts = {t.name.split(".", 3)[3]: t for t in LoraSpec(rank=4).layer_tensors(SPEC, 0)}
    h, f, q = SPEC.hidden, SPEC.ffn_hidden, SPEC.qkv_out
    assert (ts["self_attention.linear_qkv.lora_A"].shape,
            ts["self_attention.linear_qkv.lora_A"].shard_dim) == ((3 * 4, h), None)
    assert (ts["self_attention.linear_qkv.lora_B"].shape,
            ts["self_attention.linear_qkv.lora_B"].shard_dim) == ((q, 4), 0)
    assert ts["mlp.linear_fc1.lora_A"].shape == (2 * 4, h)
    fc1_b = ts["mlp.linear_fc1.lora_B"]
    assert (fc1_b.shape, fc1_b.shard_dim, fc1_b.parts) == ((2 * f, 4), 0, 2)
    # TP rank 1 of 2 holds the second half of gate and of up, as its base weight does
    assert fc1_b.shard_ranges(1, 2) == [(f // 2, f), (f + f // 2, 2 * f)]
    assert (ts["mlp.linear_fc2.lora_A"].shape, ts["mlp.linear_fc2.lora_A"].shard_dim) == \
        ((4, f), 1)
    assert (ts["mlp.linear_fc2.lora_B"].shape, ts["mlp.linear_fc2.lora_B"].shard_dim) == \
        ((h, 4), None)
    assert ts["self_attention.linear_proj.lora_A"].shard_dim == 1


def test_a_subset_of_fused_parts_has_only_their_rows():
    """q_proj and v_proj: A [2r, in]; B the q and v rows of every query group (TP splits
    whole groups); up_proj alone: B the up rows, split like one part."""
    spec = model_presets()["llama2-70b"]          # 8 query groups of 8 heads of 128
    lora = LoraSpec(rank=8, target_modules=["q_proj", "v_proj", "up_proj"])
    ts = {t.name.split(".", 3)[3]: t for t in lora.layer_tensors(spec, 0)}
    assert ts["self_attention.linear_qkv.lora_A"].shape == (16, spec.hidden)
    assert ts["self_attention.linear_qkv.lora_B"].shape == (8 * (8 * 128 + 128), 8)
    assert ts["self_attention.linear_qkv.lora_B"].shard_shape(4) == (2 * (8 * 128 + 128), 8)
    up = ts["mlp.linear_fc1.lora_B"]
    assert (up.shape, up.parts) == ((spec.ffn_hidden, 8), 1)
    assert lora.b_rows(spec, "linear_qkv", 4) == 2 * (8 * 128 + 128)
    assert lora.gemms(spec, 4) == [(spec.hidden, 16), (8, 2 * (8 * 128 + 128)),
                                   (spec.hidden, 8), (8, spec.ffn_hidden // 4)]


def test_stages_hold_their_layers_adapters_and_a_value_head():
    lora = LoraSpec(rank=4, target_modules=["linear_qkv"])
    s1 = adapter_stage_tensors(SPEC, lora, 2, 1)
    assert {t.layer for t in s1} == set(range(SPEC.n_layers // 2, SPEC.n_layers))
    assert len(s1) == 2 * SPEC.n_layers // 2
    lm = trained_stage_tensors(SPEC, "lm", lora, 2, 1)
    value = trained_stage_tensors(SPEC, "value", lora, 2, 1)
    assert [t.content for t in value if t not in lm] == ["value_head"]
    assert trained_stage_tensors(SPEC, "value", lora, 2, 0) == adapter_stage_tensors(
        SPEC, lora, 2, 0)


# ---- memory and time -----------------------------------------------------------------------

def _train_mfc():
    graph = build_graph("grpo", BatchShape(prompts_per_step=64, samples_per_prompt=4,
                                           prompt_len=256, gen_len=256), {"actor"})
    return next(m for m in graph.mfcs if m.kind == "train"), graph


def test_lora_training_keeps_gradients_and_optimizer_state_of_the_adapters_only():
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("a100-80g")))
    mfc, _ = _train_mfc()
    mesh, lay = DeviceMesh(first_gpu=0, n_gpus=8), Layout(tp=2, pp=2, dp=2)
    lora = LoraSpec(rank=16)
    full = cm.mfc_cost(mfc, SPEC, "lm", mesh, lay, 4)
    low = cm.mfc_cost(mfc, SPEC, "lm", mesh, lay, 4, lora=lora)
    cfg = cm.config
    base = cm.stage_params(SPEC, "lm", lay)
    adapters = cm.lora_params(SPEC, "lm", lay, lora)
    assert adapters == SPEC.n_layers // 2 * (lora.layer_params(SPEC)[0] / 2
                                             + lora.layer_params(SPEC)[1])
    assert low.weights_bytes == pytest.approx(cfg.param_dtype_bytes * (base + adapters))
    assert low.adapter_bytes == pytest.approx(cfg.param_dtype_bytes * adapters)
    # resident: weights + fp32 grads of the adapters + Adam's state of their DP shard
    assert low.resident_bytes - low.weights_bytes == pytest.approx(
        adapters * cfg.grad_dtype_bytes + adapters / 2 * cfg.optimizer_state_bytes_per_param)
    assert full.resident_bytes - full.weights_bytes > 30 * (low.resident_bytes
                                                           - low.weights_bytes)
    # no weight gradients of the base: its GEMMs cost two forward passes, not three
    assert low.terms_s["gemm"] < full.terms_s["gemm"]
    assert low.terms_s["gemm"] > 0.6 * full.terms_s["gemm"]


def test_adapters_add_to_inference_and_generation_time():
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("a100-80g")))
    _, graph = _train_mfc()
    mesh, lay = DeviceMesh(first_gpu=0, n_gpus=8), Layout(tp=2, pp=1, dp=4)
    for mfc in graph.mfcs:
        if mfc.kind == "train":
            continue
        plain = cm.mfc_cost(mfc, SPEC, "lm", mesh, lay, 2)
        low = cm.mfc_cost(mfc, SPEC, "lm", mesh, lay, 2, lora=LoraSpec(rank=64))
        assert low.time_s > plain.time_s, mfc.name


# ---- reallocation ----------------------------------------------------------------------------

def _pl(p: Placement) -> tuple[int, int, int, int, int]:
    return (p.mesh.first_gpu, p.mesh.n_gpus, p.layout.tp, p.layout.pp, p.layout.dp)


@pytest.mark.parametrize("head", ["lm", "value"])
def test_lora_reallocation_prices_exactly_the_adapters_the_executor_moves(head):
    """The closed form the search prices receives, per GPU, what the transfer plan the
    executor runs sends, over random placements; and it is the adapters (and a value
    head) only."""
    rng = random.Random(7)
    lora = LoraSpec(rank=8)
    spec = model_presets()["tiny-llama"]
    layouts = [Layout(tp=t, pp=p, dp=d) for t in (1, 2, 4) for p in (1, 2) for d in (1, 2)]
    n_moved = 0
    for _ in range(40):
        places = []
        for _ in range(2):
            lay = rng.choice(layouts)
            first = rng.choice(range(0, 16, lay.world))
            places.append(Placement(DeviceMesh(first_gpu=first, n_gpus=lay.world), lay))
        src, dst = places
        plan = transfer_plan(spec, head, src, dst, 4, 2, lora)
        acc = realloc_recv_send(ReallocModel.of(spec, head, 2, lora), _pl(src), _pl(dst), 4)
        closed = {g: tuple(v) for g, v in acc.recv.items() if any(v)}
        assert closed == {g: v for g, v in plan.recv_bytes(4).items() if any(v)}
        names = {c.dst_tensor for c in plan.copies}
        assert all(".lora_" in n or n == "output_layer.weight" for n in names)
        assert ("output_layer.weight" in names) == (head == "value")
        n_moved += plan.bytes_moved() > 0
    assert n_moved > 10


def test_70b_adapters_move_about_a_hundredth_of_the_bytes():
    """The 70B critic's reallocation in the full fine-tune's plan (TP2·PP8·DP1 ->
    TP1·PP4·DP4 on 16 GPUs), with and without rank-64 LoRA on all projections."""
    spec = model_presets()["llama2-70b"]
    src, dst = (0, 16, 2, 8, 1), (0, 16, 1, 4, 4)
    full = realloc_recv_send(ReallocModel.of(spec, "value", 2), src, dst, 8)
    low = realloc_recv_send(ReallocModel.of(spec, "value", 2, LoraSpec(rank=64)), src, dst, 8)
    full_b = sum(sum(v) for v in full.recv.values())
    low_b = sum(sum(v) for v in low.recv.values())
    assert full_b == 412_284_420_096           # the plan's 383.97 GiB
    assert low_b < full_b / 90
    # by hand: a rank-64 layer has 6,684,672 TP-split adapter parameters (the B of q/k/v
    # and gate/up, the A of o and down) and 3,670,016 replicated ones (q/k/v's A 3 x 64 x
    # 8192, gate/up's 2 x 64 x 8192, o's and down's B 64 x 8192 each). Each destination GPU
    # (20 layers, TP1) held 10 of its layers at TP2 (it lacks their split halves) and
    # lacks the other 10 whole: 10 x 3,342,336 + 10 x 10,354,688 parameters in bf16, on
    # each of 16 GPUs; two GPUs of the last stage also lack the value head (8,192 x 2 bytes)
    assert LoraSpec(rank=64).layer_params(spec) == (6_684_672, 3_670_016)
    assert low_b == 16 * 2 * (10 * 6_684_672 // 2 + 10 * 10_354_688) + 2 * 8192 * 2
    shared = realloc_recv_send(ReallocModel.of(spec, "value", 2, LoraSpec(rank=64, shared_a=True)),
                               src, dst, 8)
    assert sum(sum(v) for v in shared.recv.values()) == \
        16 * 2 * (10 * 6_684_672 // 2 + 10 * 8_781_824) + 2 * 8192 * 2


# ---- simulator and search --------------------------------------------------------------------

def test_the_frozen_base_stays_where_a_lora_model_is_reallocated():
    """Train on GPUs 0-3, generate on 4-7: the generating GPUs keep the base resident
    (once, though two calls use it) and receive only the adapters."""
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("a100-80g"))
    graph = build_graph("remax", BatchShape(prompts_per_step=16, samples_per_prompt=1,
                                            prompt_len=64, gen_len=64), {"actor", "reward"})
    spec = model_presets()["llama2-7b"]
    lora = LoraSpec(rank=16)
    models = {r: RoleModel(r, spec, head_of(r), lora if r == "actor" else None)
              for r in ("actor", "reward")}
    prob = build_problem(graph, models, CostModel(cluster), n_iters=1)
    assert prob.model_lora == [r == "actor" for r in (m.role for m in prob.models)]

    def pick(i, first, n):
        return next(j for j, c in enumerate(prob.cands[i])
                    if (c.first_gpu, c.n_gpus, c.tp, c.pp) == (first, n, 1, 1))
    assign = []
    for i, m in enumerate(graph.mfcs):
        assign.append(pick(i, 0, 4) if m.kind == "train" or m.role != "actor" else pick(i, 4, 4))
    peak, _ = memory(prob, assign)
    gens = [i for i, m in enumerate(graph.mfcs) if m.role == "actor" and m.kind != "train"]
    assert len(gens) >= 2
    c = prob.cands[gens[0]][assign[gens[0]]]
    base_bytes = CostModel(cluster).config.param_dtype_bytes * CostModel.stage_params(
        spec, "lm", c.layout())
    assert c.resident_bytes == pytest.approx(base_bytes)
    assert c.weights_bytes < base_bytes / 50
    transient = max(prob.cands[i][assign[i]].activation_bytes + prob.cands[i][assign[i]]
                    .weights_bytes for i in gens)
    assert len({prob.cands[i][assign[i]].shards for i in gens}) == 1
    assert peak[4] == pytest.approx(base_bytes + transient)     # the base counted once


def test_70b_ppo_on_16_a100s_plans_with_lora_and_no_offload():
    import yaml

    from realign.config.experiment import ExperimentConfig
    from realign.run.planning import plan_experiment

    path = ROOT / "experiments/public/ppo-llama2-70b-16gpu-lora.yaml"
    cfg = ExperimentConfig(**yaml.safe_load(path.read_text()))
    plan = plan_experiment(cfg)
    trains = [a for a in plan.allocations if a.kind == "train"]
    assert trains and not any(a.optimizer_offload or a.train_state_offload for a in trains)
    # the reference and the reward model are the LoRA models' bases (lora.<role>.share_base)
    assert {m.role: m.lora is not None for m in plan.models} == {"actor": True, "critic": True}
    assert max(a.mem_bytes for a in plan.allocations) <= 72 * 2 ** 30
    from planner.plan import ExecutionPlan
    assert ExecutionPlan.from_json(plan.to_json()) == plan        # lossless, lora included
    from planner.report import summary, table
    # PEFT's count for rank 64 on all seven projections of LLaMA-2 70B
    assert summary(plan)["lora"]["actor"]["trained_params"] == 828_375_040
    assert "actor: LoRA rank 64 (scale 2)" in table(plan)


def test_a_saved_plan_with_other_lora_settings_is_refused():
    from planner.errors import PlanError
    from planner.search.manual import check_plan_matches

    path = ROOT / "experiments/public/ppo-llama2-70b-16gpu-lora.yaml"
    import yaml

    from realign.config.experiment import ExperimentConfig
    from realign.run.planning import experiment_graph, plan_experiment, resolve_models
    cfg = ExperimentConfig(**yaml.safe_load(path.read_text()))
    plan = plan_experiment(cfg)
    models = resolve_models(cfg)
    graph = experiment_graph(cfg, models)
    check_plan_matches(plan, graph, models, cfg.cluster.spec())       # the same: accepted
    other = {r: RoleModel(m.role, m.spec, m.head, LoraSpec(rank=8) if m.lora else None)
             for r, m in models.items()}
    with pytest.raises(PlanError, match="the plan's actor has LoRA rank 64 .* rank 8") as e:
        check_plan_matches(plan, graph, other, cfg.cluster.spec())
    assert e.value.field == "plan.file"


def test_multi_turn_generation_of_a_lora_model_carries_its_adapters():
    """A multi-turn rollout is priced turn by turn with the adapters in each pass, and
    keeps the adapters' bytes (what its reallocation moves)."""
    from planner.graph.turns import Turns

    graph = build_graph("grpo", BatchShape(prompts_per_step=8, samples_per_prompt=4,
                                           prompt_len=16, gen_len=64), {"actor"},
                        turns=Turns(turns=2, turn_tokens=16, obs_tokens=8))
    mfc = next(m for m in graph.mfcs if m.kind == "generate")
    assert mfc.turns is not None
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("a100-80g")))
    args = (mfc, SPEC, "lm", DeviceMesh(first_gpu=0, n_gpus=1), Layout(tp=1, pp=1, dp=1), 1)
    plain, low = cm.mfc_cost(*args), cm.mfc_cost(*args, lora=LoraSpec(rank=64))
    assert low.time_s > plain.time_s
    assert low.adapter_bytes == pytest.approx(
        cm.config.param_dtype_bytes * LoraSpec(rank=64).total_params(SPEC))
