"""Another system's trainer (``train_engine``): Hugging Face layers run eagerly, each
layer of a scoring or training pass paying the device's eager per-layer host cost and,
under a sharded wrapper (FSDP, ZeRO-3), its hooks' cost (planner/cost/peer_engines.py);
data parallel only, its weights and gradients sharded over the ranks."""
from __future__ import annotations

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.peer_engines import (
    SHARDED_UNIT_HOOK_S,
    TrainEngine,
    peer_layer_s,
    train_engine_options,
)
from planner.cost.vllm_cost import generate_engine_options
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

SPEC = model_presets()["qwen2.5-0.5b"]
MESH = DeviceMesh(first_gpu=0, n_gpus=8)


def call(kind: str) -> MFC:
    return MFC(name=f"actor.{kind}", role="actor", kind=kind, n_seqs=512, prompt_len=104,
               gen_len=192, input_keys=("seqs",), output_keys=("out",))


def model(engine: TrainEngine, device: str = "a100-80g") -> CostModel:
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device(device))
    return CostModel(cluster, CostModelConfig(train_engine=engine))


def test_layer_cost_is_the_eager_layer_plus_the_hooks() -> None:
    eager = 1.2e-3
    assert peer_layer_s("own", "train", eager) is None
    assert peer_layer_s("hf_sharded", "decode", eager) is None
    assert peer_layer_s("hf", "inference", eager) == pytest.approx(eager)
    assert peer_layer_s("hf", "train", eager) == pytest.approx(3 * eager)
    assert peer_layer_s("hf_sharded", "inference", eager) == pytest.approx(
        eager + SHARDED_UNIT_HOOK_S)
    assert peer_layer_s("hf_sharded", "train", eager) == pytest.approx(
        3 * eager + 3 * SHARDED_UNIT_HOOK_S)


def test_host_bound_training_pays_the_layers_per_micro_batch() -> None:
    """A small model's micro-batches are host-bound on the sharded engine: each costs
    its layers' host time, so 16 micro-batches cost 16 x the layers, and far more than
    realign's own engine."""
    lay = Layout(tp=1, pp=1, dp=8)
    sharded, own = model("hf_sharded"), model("own")
    per_layer = peer_layer_s("hf_sharded", "train",
                             sharded.cluster.device.decode_layer_overhead_s)
    assert per_layer is not None
    t16 = sharded.mfc_cost(call("train"), SPEC, "lm", MESH, lay, 16).time_s
    t8 = sharded.mfc_cost(call("train"), SPEC, "lm", MESH, lay, 8).time_s
    assert t16 - t8 == pytest.approx(8 * SPEC.n_layers * per_layer, rel=0.05)
    assert t16 > 5 * own.mfc_cost(call("train"), SPEC, "lm", MESH, lay, 16).time_s


def test_peer_engine_runs_data_parallel_only_and_shards_its_state() -> None:
    sharded, own, hf = model("hf_sharded"), model("own"), model("hf")
    for kind in ("train", "inference"):
        assert sharded.engine_options(call(kind), Layout(tp=2, pp=1, dp=4), 1) == ()
        assert sharded.engine_options(call(kind), Layout(tp=1, pp=2, dp=4), 1) == ()
        assert sharded.engine_options(call(kind), Layout(tp=1, pp=1, dp=8), 1) == ("own",)
        assert own.engine_options(call(kind), Layout(tp=2, pp=1, dp=4), 1) == ("own",)
    lay = Layout(tp=1, pp=1, dp=8)
    b_sh = sharded.mfc_bytes(call("train"), SPEC, "lm", MESH, lay, 1)
    b_hf = hf.mfc_bytes(call("train"), SPEC, "lm", MESH, lay, 1)
    assert b_sh.weights_bytes == pytest.approx(b_hf.weights_bytes / 8)
    # bf16 weights and fp32 gradients: 1/8 of each kept; the optimizer state sharded alike
    whole = b_hf.weights_bytes + 2 * b_hf.weights_bytes
    assert b_sh.resident_bytes == pytest.approx(b_hf.resident_bytes - 7 / 8 * whole)


def test_default_engine_is_unchanged_on_every_preset() -> None:
    """realign's own engine keeps the preset's layer_overhead_s (the cpu preset
    included): the setting only prices other systems' runs."""
    for device in ("cpu", "a100-80g", "h100-80g", "h200"):
        m = model("own", device)
        dev = m.cluster.device
        assert m.rates.engine("train").layer_s == pytest.approx(3 * dev.layer_overhead_s)
        assert m.rates.engine("inference").layer_s == pytest.approx(dev.layer_overhead_s)


@pytest.mark.parametrize("engine,tp,pp,want", [("own", 2, 2, ("own",)), ("hf", 1, 1, ("own",)),
                                               ("hf_sharded", 2, 1, ()),
                                               ("hf_sharded", 1, 2, ())])
def test_another_trainer_is_priced_data_parallel_only(engine, tp, pp, want):
    lay = Layout(tp=tp, pp=pp, dp=8 // (tp * pp))
    assert train_engine_options(engine, lay) == want
    assert model(engine).engine_options(call("train"), lay, 1) == want


@pytest.mark.parametrize("mode,pp,mb,want", [("own", 1, 1, ("own",)),
                                             ("auto", 1, 1, ("own", "vllm")),
                                             ("auto", 2, 1, ("own",)),
                                             ("vllm", 1, 2, ()), ("vllm", 1, 1, ("vllm",))])
def test_a_generate_call_runs_on_vllm_at_pp_1_and_one_micro_batch(mode, pp, mb, want):
    assert generate_engine_options(mode, Layout(tp=2, pp=pp, dp=8 // (2 * pp)), mb) == want
