"""A LoRA actor's generate call on vLLM, priced: its adapters (PEFT's layout) move each
call, never its base; on a GPU through host memory and back; the rank vLLM cannot take
is not offered."""
from __future__ import annotations

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.vllm_cost import (
    LOAD_PASSES,
    adapter_load_s,
    peft_adapter_params,
    vllm_generate_cost,
)
from planner.errors import InfeasibleError
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.lora import LoraSpec
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec, model_presets

pytestmark = pytest.mark.pure

SMALL = ModelSpec(name="small", n_layers=4, hidden=256, n_heads=8, n_kv_heads=4,
                  ffn_hidden=768, vocab_size=128)
LORA = LoraSpec(rank=8, alpha=16)


def gen(n=64, prompt=8, cap=16) -> MFC:
    return MFC(name="actor.generate", role="actor", kind="generate", n_seqs=n,
               prompt_len=prompt, gen_len=cap, input_keys=("prompts",),
               output_keys=("seqs", "logprobs"))


def model(device: str, gpus: int = 1, dtype_bytes: int = 4) -> CostModel:
    return CostModel(ClusterSpec(n_nodes=1, gpus_per_node=gpus, device=resolve_device(device)),
                     CostModelConfig(param_dtype_bytes=dtype_bytes, vllm_kv_cache_bytes=2 ** 30))


def test_peft_adapter_params_by_hand():
    # per layer: A of 8 rows for q, k, v, gate, up (in 256) and o (in 256), down (in 768);
    # B of 8 columns for 256 + 128 + 128 + 256 + 768 + 768 + 256 output rows
    per_layer = 8 * (6 * 256 + 768) + 8 * 2560
    assert peft_adapter_params(SMALL, LORA) == 4 * per_layer == 155_648
    # shared_a trains one A per fused layer, but vLLM is handed PEFT's: one per part
    assert peft_adapter_params(SMALL, LORA.model_copy(update={"shared_a": True})) == 155_648


def test_cpu_call_moves_the_adapters_not_the_weights():
    cm = model("cpu")
    mesh, lay = DeviceMesh(first_gpu=0, n_gpus=1), Layout(tp=1, pp=1, dp=1)
    full = vllm_generate_cost(cm, gen(), SMALL, "lm", mesh, lay)
    lora = vllm_generate_cost(cm, gen(), SMALL, "lm", mesh, lay, LORA)
    adapter_bytes = 4 * 155_648
    assert "weight_load" not in lora.terms_s and "adapter_load" not in full.terms_s
    assert lora.terms_s["adapter_load"] == pytest.approx(
        LOAD_PASSES * adapter_bytes / cm.rates.mem_bytes_per_s)
    assert lora.terms_s["adapter_load"] < full.terms_s["weight_load"] / 5
    # everything else priced alike
    for k, v in full.terms_s.items():
        if k != "weight_load":
            assert lora.terms_s[k] == pytest.approx(v)
    # the cost model's entry point prices LoRA on vLLM the same
    via = cm.mfc_cost(gen(), SMALL, "lm", mesh, lay, 1, engine="vllm", lora=LORA)
    assert via.terms_s == lora.terms_s and via.adapter_bytes > 0


def test_gpu_call_adds_the_host_round_trip_and_the_tp_gather():
    cm = model("h100-80g", gpus=2, dtype_bytes=2)
    spec = model_presets()["llama3-8b"]
    lora = LoraSpec(rank=64, alpha=128)
    b = 2 * peft_adapter_params(spec, lora)
    c = vllm_generate_cost(cm, gen(), spec, "lm", DeviceMesh(first_gpu=0, n_gpus=2),
                           Layout(tp=2, pp=1, dp=1), lora)
    want = (cm.rates.collective_s("all_gather", b, 2, 1)
            + LOAD_PASSES * b / cm.rates.mem_bytes_per_s
            + 2 * b / cm.rates.host_link_bytes_per_s)
    assert c.terms_s["adapter_load"] == pytest.approx(want)
    assert adapter_load_s(cm, b, 2, 1) == pytest.approx(want)
    assert 3e8 < b < 4e8     # rank 64 on all seven projections of an 8B model, bf16


def test_a_rank_vllm_cannot_take_is_not_priced():
    with pytest.raises(ValueError, match="up to 512"):
        vllm_generate_cost(model("cpu"), gen(), SMALL, "lm", DeviceMesh(first_gpu=0, n_gpus=1),
                           Layout(tp=1, pp=1, dp=1), LoraSpec(rank=1024))


def test_a_lora_actor_is_planned_on_vllm_and_the_table_says_adapters_move():
    from planner.graph.algorithms import BatchShape, build_graph
    from planner.report import table
    from planner.search.problem import RoleModel, head_of
    from planner.search.search import SearchSettings, search

    shape = BatchShape(prompts_per_step=16, samples_per_prompt=4, prompt_len=8, gen_len=64,
                       gen_len_mean=8, ppo_minibatches=1)
    spec = model_presets()["tiny-llama"]
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("cpu"))
    graph = build_graph("grpo", shape, {"actor"}, score_rollout=True)
    cfg = CostModelConfig(param_dtype_bytes=4, distributed_optimizer=False,
                          generate_engine="vllm")
    fast = SearchSettings(time_limit_s=2.0, anneal_steps=5000)
    plan = search("lora", graph, {"actor": RoleModel("actor", spec, head_of("actor"), LORA)},
                  cluster, cfg, settings=fast)
    assert plan.allocation("actor.generate").engine == "vllm"
    assert "the actor's LoRA adapters (its base loaded once, at start)" in table(plan)
    # above vLLM's largest rank the search offers no vLLM allocation at all
    beyond = {"actor": RoleModel("actor", spec, head_of("actor"), LoraSpec(rank=1024))}
    with pytest.raises(InfeasibleError, match="on vLLM"):
        search("beyond", graph, beyond, cluster, cfg, settings=fast)
