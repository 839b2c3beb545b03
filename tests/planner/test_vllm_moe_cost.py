"""A mixture of experts' generate call on vLLM, priced: its decode steps pay for the
experts their rows reach and the top-k experts' FLOPs (planner.cost.moe_terms), not for
a dense MLP of every expert; each engine holds every expert whatever the replica's EP,
so its passes are EP 1's, its memory holds all experts, and a replica at EP > 1 first
gathers the experts its EP group's other ranks hold."""
from __future__ import annotations

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.vllm_cost import experts_gather_s, vllm_generate_cost
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

MOE = model_presets()["qwen3-30b-a3b"]


def gen(n=256, prompt=512, cap=1024) -> MFC:
    return MFC(name="actor.generate", role="actor", kind="generate", n_seqs=n,
               prompt_len=prompt, gen_len=cap, input_keys=("prompts",),
               output_keys=("seqs", "logprobs"))


def model(gpus: int = 8) -> CostModel:
    return CostModel(ClusterSpec(n_nodes=1, gpus_per_node=gpus, device=resolve_device("h100-80g")),
                     CostModelConfig(param_dtype_bytes=2, vllm_kv_cache_bytes=20 * 2 ** 30))


def decode_s(cost) -> float:
    return sum(v for k, v in cost.terms_s.items() if k.startswith("decode_"))


def test_decode_pays_for_the_active_experts_not_all():
    cm, mesh, lay = model(1), DeviceMesh(first_gpu=0, n_gpus=1), Layout(tp=1, pp=1, dp=1)
    assert MOE.moe is not None
    # the same model with every expert chosen by every token: each step reads and
    # multiplies by all 128 experts
    every = MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"top_k": 128})})
    # one sequence: a decode step reads the 8 experts its token reaches, of 128
    one = vllm_generate_cost(cm, gen(n=1), MOE, "lm", mesh, lay)
    one_all = vllm_generate_cost(cm, gen(n=1), every, "lm", mesh, lay)
    assert decode_s(one) < decode_s(one_all) / 4
    # 256 sequences at once reach nearly every expert: the weight reads converge, and
    # the top-k FLOPs still differ
    many = vllm_generate_cost(cm, gen(), MOE, "lm", mesh, lay)
    many_all = vllm_generate_cost(cm, gen(), every, "lm", mesh, lay)
    assert decode_s(one_all) / decode_s(one) > decode_s(many_all) / decode_s(many) > 1.0


def test_engine_holds_every_expert_and_is_priced_at_ep1():
    cm, mesh = model(8), DeviceMesh(first_gpu=0, n_gpus=8)
    ep1 = vllm_generate_cost(cm, gen(), MOE, "lm", mesh, Layout(tp=2, pp=1, dp=4))
    ep4 = vllm_generate_cost(cm, gen(), MOE, "lm", mesh, Layout(tp=2, pp=1, dp=4, ep=4))
    for k, v in ep1.terms_s.items():
        if k != "weight_load":
            assert ep4.terms_s[k] == pytest.approx(v), k
    assert "ep_comm" not in "".join(ep4.terms_s)
    gather = experts_gather_s(cm, MOE, mesh, Layout(tp=2, pp=1, dp=4, ep=4))
    assert gather > 0
    assert ep4.terms_s["weight_load"] == pytest.approx(ep1.terms_s["weight_load"] + gather)
    # realign's copy holds a quarter of the experts; vLLM's copy all of them
    assert ep4.weights_bytes < ep1.weights_bytes
    assert ep4.activation_bytes == pytest.approx(ep1.activation_bytes)
    expert_bytes = 2 * MOE.sparse_layers() * MOE.layer_expert_params() / 2
    assert ep1.weights_bytes - ep4.weights_bytes == pytest.approx(expert_bytes * 3 / 4, rel=1e-6)


def test_experts_gather_by_hand():
    cm, mesh = model(8), DeviceMesh(first_gpu=0, n_gpus=8)
    assert experts_gather_s(cm, MOE, mesh, Layout(tp=2, pp=1, dp=4)) == 0.0
    nbytes = 2 * 48 * (128 * 3 * 768 * 2048) / 2
    assert experts_gather_s(cm, MOE, mesh, Layout(tp=2, pp=1, dp=4, ep=2)) == pytest.approx(
        cm.rates.collective_s("all_gather", nbytes, 2, 1))
