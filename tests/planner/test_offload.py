"""Optimizer offload and activation recompute as plan options: their cost terms by hand,
the search choosing offload where the GPUs are too small, and the plan carrying both
to the run."""
from __future__ import annotations

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.offload_terms import (
    offload_options,
    offload_step_s,
    state_offload_options,
    state_transfer_s,
)
from planner.errors import InfeasibleError
from planner.graph.algorithms import BatchShape, build_graph
from planner.plan import ExecutionPlan
from planner.search.problem import RoleModel, head_of
from planner.search.search import SearchSettings, search
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

A100 = resolve_device("a100-80g")
FAST = SearchSettings(time_limit_s=5.0, anneal_steps=5000)


def sft(model: str, gpus: int, device=A100):
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=gpus, device=device)
    models = {"actor": RoleModel("actor", model_presets()[model], head_of("actor"))}
    graph = build_graph("sft", BatchShape(prompts_per_step=8, prompt_len=64, gen_len=64,
                                          ppo_minibatches=1), {"actor"})
    return graph, models, cluster


def test_offload_step_is_the_transfers_and_the_host_adam():
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=1, device=A100))
    # fp32 grads down, fp32 main weights up (8 bytes/param) at 25 GB/s, Adam at 5e8/s
    assert offload_step_s(cm.config, A100, cm.rates, 1e9) == pytest.approx(8e9 / 25e9 + 1e9 / 5e8)


def test_offload_moves_optimizer_state_to_the_host_and_costs_its_step():
    graph, models, cluster = sft("llama2-7b", 8)
    cm = CostModel(cluster)
    train = graph.mfcs[-1]
    spec = models["actor"].spec
    lay = Layout(tp=2, pp=1, dp=4)
    on = cm.mfc_cost(train, spec, "lm", DeviceMesh(first_gpu=0, n_gpus=8), lay, 1, True)
    off = cm.mfc_cost(train, spec, "lm", DeviceMesh(first_gpu=0, n_gpus=8), lay, 1, False)
    shard = cm.stage_params(spec, "lm", lay) / 4          # the distributed optimizer's shard
    # the GPU keeps a 4-byte fp32 main weight instead of 12 bytes of optimizer state
    assert off.resident_bytes - on.resident_bytes == pytest.approx(8 * shard)
    assert on.host_bytes == pytest.approx(16 * shard) and off.host_bytes == 0
    # the host step replaces the GPU's: it adds the transfers and the CPU Adam
    host_s = offload_step_s(cm.config, cluster.device, cm.rates, shard)
    assert on.terms_s["optimizer_offload"] == pytest.approx(host_s)
    assert on.time_s > off.time_s
    assert on.activation_bytes == off.activation_bytes


def test_only_train_calls_on_devices_that_offer_it_are_offloaded():
    graph, _models, cluster = sft("llama2-7b", 1)
    train = graph.mfcs[-1]
    dev = cluster.device
    assert offload_options(CostModelConfig(), dev, train) == (False, True)
    assert offload_options(CostModelConfig(optimizer_offload="always"), dev, train) == (True,)
    assert offload_options(CostModelConfig(optimizer_offload="never"), dev, train) == (False,)
    assert offload_options(CostModelConfig(distributed_optimizer=False), dev,
                           train) == (False,)
    cpu = cluster.model_copy(update={"device": resolve_device("cpu")})
    assert offload_options(CostModelConfig(), cpu.device, train) == (False,)


def test_a_7b_sft_fits_one_a100_only_with_offload_and_the_plan_says_so():
    graph, models, cluster = sft("llama2-7b", 1)
    with pytest.raises(InfeasibleError, match="actor.train"):
        search("no-offload", graph, models, cluster,
               CostModelConfig(optimizer_offload="never"), settings=FAST)
    plan = search("offload", graph, models, cluster, settings=FAST)
    a = plan.allocation("actor.train")
    assert a.optimizer_offload and a.host_bytes > 0
    assert max(plan.peak_mem_bytes) <= plan.mem_limit_bytes
    back = ExecutionPlan.from_json(plan.to_json())
    assert back.allocation("actor.train").optimizer_offload


def test_offload_is_not_chosen_where_it_only_costs_time():
    graph, models, cluster = sft("llama2-7b", 8)
    plan = search("roomy", graph, models, cluster, settings=FAST)
    assert not plan.allocation("actor.train").optimizer_offload


def test_host_memory_bounds_offload_and_the_error_says_so():
    small_host = A100.model_copy(update={"host_mem_bytes": 8 * 2 ** 30})
    graph, models, cluster = sft("llama2-7b", 1, small_host)
    with pytest.raises(InfeasibleError, match="host_mem_bytes"):
        search("small-host", graph, models, cluster, settings=FAST)


def test_activation_recompute_adds_one_forward_of_the_layers_and_saves_memory():
    graph, models, cluster = sft("llama2-7b", 8)
    train, spec = graph.mfcs[-1], models["actor"].spec
    mesh, lay = DeviceMesh(first_gpu=0, n_gpus=8), Layout(tp=8, pp=1, dp=1)
    plain = CostModel(cluster).mfc_cost(train, spec, "lm", mesh, lay, 2)
    rc = CostModel(cluster).mfc_cost(train, spec, "lm", mesh, lay, 2, recompute=True)
    # forward + backward GEMMs are 6 units of work, the recomputed forward 2 more, for
    # the layers (the head is not recomputed): between 1 and 4/3 of the GEMM time
    assert plain.terms_s["gemm"] < rc.terms_s["gemm"] < 4 / 3 * plain.terms_s["gemm"] * 1.0001
    assert rc.terms_s["tp_comm"] > plain.terms_s["tp_comm"]
    assert rc.activation_bytes < plain.activation_bytes


def test_the_run_program_carries_offload_and_recompute_to_the_train_call():
    from realign.run.ops import Call
    from realign.run.program import compile_program
    graph, models, cluster = sft("llama2-7b", 1)
    plan = search("offload", graph, models, cluster,
                  CostModelConfig(recompute="always"), settings=FAST)
    calls = [op for op in compile_program(plan).ops if isinstance(op, Call)]
    (train,) = [c for c in calls if c.kind == "train"]
    assert train.optimizer_offload and train.activation_recompute


def test_state_transfer_is_the_kept_state_down_and_up():
    from planner.cost.profile import ProfileTable
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=1, device=A100)
    cm = CostModel(cluster)
    # 1.2e10 bytes of main weights and moments, up before the call and down after it
    assert state_transfer_s(cm.rates, 1.2e10) == pytest.approx(2 * 1.2e10 / 25e9)
    # a profile's measured host link replaces the preset's (and the offload step's)
    measured = CostModel(cluster, profile=ProfileTable(device="a100-80g",
                                                       host_link_bytes_per_s=12.5e9))
    assert state_transfer_s(measured.rates, 1.2e10) == pytest.approx(2 * 1.2e10 / 12.5e9)
    assert offload_step_s(measured.config, A100, measured.rates, 1e9) == pytest.approx(
        8e9 / 12.5e9 + 1e9 / 5e8)


@pytest.mark.parametrize("optimizer_offload", [False, True])
def test_state_offload_keeps_only_the_weights_resident(optimizer_offload):
    graph, models, cluster = sft("llama2-7b", 8)
    cm = CostModel(cluster)
    train, spec = graph.mfcs[-1], models["actor"].spec
    mesh, lay = DeviceMesh(first_gpu=0, n_gpus=8), Layout(tp=2, pp=1, dp=4)
    base = cm.mfc_cost(train, spec, "lm", mesh, lay, 1, optimizer_offload)
    parked = cm.mfc_cost(train, spec, "lm", mesh, lay, 1, optimizer_offload, True)
    p_gpu = cm.stage_params(spec, "lm", lay)
    shard = p_gpu / 4
    # the GPU keeps the fp32 main weights (and Adam's m and v without optimizer offload)
    kept = (4 if optimizer_offload else 12) * shard
    assert parked.resident_bytes == pytest.approx(2 * p_gpu)          # bf16 weights only
    # during the call: the fp32 gradients and the kept state on top of the activations
    assert parked.activation_bytes == pytest.approx(base.activation_bytes + 4 * p_gpu + kept)
    assert parked.host_bytes == pytest.approx(base.host_bytes + kept)
    assert parked.terms_s["state_offload"] == pytest.approx(2 * kept / 25e9)
    assert parked.time_s == pytest.approx(base.time_s + parked.terms_s["state_offload"])


def test_state_offload_options_and_manual_plans():
    from planner.search.manual import manual_plan
    from planner.specs.layout import Allocation
    graph, models, cluster = sft("llama2-7b", 8)
    train = graph.mfcs[-1]
    assert state_offload_options(CostModelConfig(), cluster.device, train) == (False, True)
    cpu = cluster.model_copy(update={"device": resolve_device("cpu")})
    assert state_offload_options(CostModelConfig(), cpu.device, train) == (False,)
    assert state_offload_options(CostModelConfig(train_state_offload="always"), cpu.device,
                                 train) == (True,)
    # a hand-made plan gets it only from 'always'
    alloc = {m.name: Allocation(mesh=DeviceMesh(first_gpu=0, n_gpus=8),
                                layout=Layout(tp=8, pp=1, dp=1), micro_batches=1)
             for m in graph.mfcs}
    for mode, want in (("auto", False), ("always", True)):
        plan = manual_plan("m", graph, models, cluster, alloc,
                           CostModelConfig(train_state_offload=mode))
        assert plan.allocation("actor.train").train_state_offload is want


def test_70b_ppo_on_16_a100s_plans_with_the_training_state_on_the_host():
    """The public setting that needed it (docs/cost-model.md: settings public systems run): both
    trained 70B models park their state between calls; it fits GPUs and host."""
    from pathlib import Path

    from realign.run.loading import load_experiment
    from realign.run.planning import plan_experiment
    repo = Path(__file__).resolve().parents[2]
    cfg = load_experiment(repo / "experiments/public/ppo-llama2-70b-16gpu.yaml")
    plan = plan_experiment(cfg.model_copy(update={"plan": cfg.plan.model_copy(
        update={"time_limit_s": 20.0})}))
    for name in ("actor.train", "critic.train"):
        a = plan.allocation(name)
        assert a.train_state_offload
        assert a.host_bytes * 2 <= plan.cluster.device.host_mem_bytes
    assert max(plan.peak_mem_bytes) <= plan.mem_limit_bytes
