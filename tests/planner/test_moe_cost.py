"""A mixture of experts in the cost model (planner.cost.moe_terms): memory holds every
expert (weights, gradients, optimizer state), compute runs the router and the top-k
experts, a pass reads the experts it touches, the KV cache is the dense attention's;
dense prices are unchanged (test_cost_model.py and test_engine_terms.py pin them)."""
from __future__ import annotations

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.engine_terms import layer_gemms
from planner.cost.moe_terms import experts_hit, sparse_mlp_s
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, DeviceSpec, device_presets
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec, MoeSpec, model_presets

pytestmark = pytest.mark.pure

R = 1e12
#: round rates, every efficiency 1: a GEMM of many rows costs its FLOPs / 1e12
DEV = DeviceSpec(name="toy", peak_flops=R, mem_bytes=1e9, mem_bw_bytes_per_s=1e12,
                 intra_node_bytes_per_s=1e10, inter_node_bytes_per_s=1e9,
                 intra_node_latency_s=1e-6, inter_node_latency_s=1e-5)
EXACT = CostModelConfig(matmul_efficiency=1.0, mem_bw_efficiency=1.0, link_efficiency=1.0,
                        gemm_half_width=0)
#: 4 layers, h 64, 4 heads of 16, 2 KV heads; 8 experts of 32, top 2 (dense MLP 128)
MOE = ModelSpec(name="toy-moe", family="qwen3_moe", n_layers=4, hidden=64, n_heads=4,
                n_kv_heads=2, ffn_hidden=128, vocab_size=128, qk_norm=True,
                moe=MoeSpec(n_experts=8, top_k=2, expert_ffn_hidden=32))
DENSE = ModelSpec(name="toy", family="qwen3", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2,
                  ffn_hidden=128, vocab_size=128, qk_norm=True)


def flops(m: float, k: float, n: float) -> float:
    return 2 * m * k * n


def weight_elems(m: float, k: float, n: float) -> float:
    return k * n


def test_compute_is_the_router_and_the_top_k_experts():
    """Per token: router 64 x 8, two experts of 3 x 32 x 64 (split by TP)."""
    for tp in (1, 2):
        got = sparse_mlp_s(MOE, 100.0, tp, flops)
        assert got == pytest.approx(2 * 100 * (64 * 8 + 2 * 3 * 32 * 64 / tp), rel=1e-12)
    assert sparse_mlp_s(DENSE, 100.0, 1, flops) == 0.0
    assert layer_gemms(MOE, 1) == [(64, 128), (64, 64)]         # attention only


def test_a_pass_reads_the_experts_its_tokens_touch():
    """One token touches its top 2 experts; many tokens all 8 (uniform routing)."""
    expert = 3 * 32 * 64
    assert sparse_mlp_s(MOE, 1.0, 1, weight_elems) == pytest.approx(2 * expert + 64 * 8)
    assert sparse_mlp_s(MOE, 1e4, 1, weight_elems) == pytest.approx(8 * expert + 64 * 8)
    assert experts_hit(128, 8, 1) == pytest.approx(8.0)
    assert experts_hit(128, 8, 16) == pytest.approx(128 * (1 - (120 / 128) ** 16))


def test_dense_layers_are_priced_as_the_dense_mlp():
    half = MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"dense_layers": (0, 2)})})
    dense = 2 * 100 * 3 * 128 * 64
    sparse = 2 * 100 * (64 * 8 + 2 * 3 * 32 * 64)
    assert sparse_mlp_s(half, 100.0, 1, flops) == pytest.approx((dense + sparse) / 2)


def cost_model(device=DEV, config=EXACT, gpn=2) -> CostModel:
    return CostModel(ClusterSpec(n_nodes=1, gpus_per_node=gpn, device=device), config)


def mfc(kind, n_seqs=8, prompt=16, gen=32) -> MFC:
    return MFC(name=f"actor.{kind}", role="actor", kind=kind, n_seqs=n_seqs, prompt_len=prompt,
               gen_len=gen, input_keys=("d",), output_keys=("o",))


def test_inference_gemms_are_the_active_parameters():
    """Every GEMM of 384 rows is compute-bound on the toy device: FLOPs over 1e12 of
    attention (12288), router (512) and two experts (12288) per layer, and the head."""
    c = cost_model().mfc_cost(mfc("inference"), MOE, "lm", DeviceMesh(first_gpu=0, n_gpus=1),
                              Layout(), 1)
    rows = 8 * 48
    assert c.terms_s["gemm"] == pytest.approx(rows * 2 * (4 * (12288 + 512 + 12288) + 8192) / R,
                                              rel=1e-9)
    assert MOE.matmul_params_per_token("lm") == 4 * (12288 + 512 + 12288) + 8192


def test_memory_holds_every_expert_with_its_gradients_and_optimizer_state():
    cm = cost_model()
    one = DeviceMesh(first_gpu=0, n_gpus=1)
    c = cm.mfc_cost(mfc("train"), MOE, "lm", one, Layout(), 1)
    total = MOE.total_params("lm")
    assert total > 2 * MOE.active_params("lm")
    assert c.weights_bytes == 2 * total                       # bf16 weights, all experts
    per_param = EXACT.grad_dtype_bytes + EXACT.optimizer_state_bytes_per_param
    assert c.resident_bytes - c.weights_bytes == pytest.approx(per_param * total)
    two = cm.mfc_cost(mfc("train"), MOE, "lm", DeviceMesh(first_gpu=0, n_gpus=2),
                      Layout(tp=2), 1)
    split = 4 * MOE.layer_sharded_params() + MOE.embedding_params() * 2
    whole = 4 * MOE.layer_replicated_params() + 64
    assert two.weights_bytes == pytest.approx(2 * (split / 2 + whole))


def test_the_kv_cache_is_the_dense_attention_cache():
    cm = cost_model()
    for layout in (Layout(), Layout(tp=2)):
        assert cm.kv_cache_bytes(MOE, mfc("generate"), layout, 1) == cm.kv_cache_bytes(
            DENSE, mfc("generate"), layout, 1)


def twins(spec: ModelSpec) -> tuple[ModelSpec, ModelSpec]:
    """Dense models with the MoE's attention and an MLP as wide as its active experts,
    or as all of them."""
    moe = spec.moe
    def dense(ffn):
        return spec.model_copy(update={"family": "qwen3", "moe": None, "ffn_hidden": ffn})
    return dense(moe.top_k * moe.expert_ffn_hidden), dense(moe.n_experts * moe.expert_ffn_hidden)


def test_qwen3_30b_decode_reads_the_experts_its_rows_touch():
    """On an H100 at TP4 decode is memory-bound: one sequence reads its 8 experts per
    layer, near a dense model of the active size; 64 sequences touch nearly all 128,
    near a dense model of the total size; 8 sequences (51.6 experts) in between.
    Training's GEMMs (compute-bound) cost at least the active-size model's (more: an
    expert's GEMM is narrower, so slower per FLOP), far below the total-size model's."""
    spec = model_presets()["qwen3-30b-a3b"]
    active, total = twins(spec)
    assert total.total_params() == pytest.approx(spec.total_params(), rel=0.01)
    cm = cost_model(device=device_presets()["h100-80g"], config=CostModelConfig(), gpn=8)
    mesh = DeviceMesh(first_gpu=0, n_gpus=4)

    def decode_gemm_s(s: ModelSpec, n: int) -> float:
        gen = MFC(name="actor.generate", role="actor", kind="generate", n_seqs=n,
                  prompt_len=256, gen_len=256, input_keys=("d",), output_keys=("o",))
        return cm.mfc_cost(gen, s, "lm", mesh, Layout(tp=4), 1).terms_s["decode_gemm"]
    one, eight, many = (decode_gemm_s(spec, n) for n in (1, 8, 64))
    assert decode_gemm_s(active, 1) <= one < 1.1 * decode_gemm_s(active, 1)
    assert one < eight < many
    assert 0.9 * decode_gemm_s(total, 64) < many <= decode_gemm_s(total, 64)
    train = MFC(name="actor.train", role="actor", kind="train", n_seqs=64, prompt_len=512,
                gen_len=512, input_keys=("d",), output_keys=("o",))
    tr = [cm.mfc_cost(train, s, "lm", mesh, Layout(tp=4), 8).terms_s["gemm"]
          for s in (active, spec, total)]
    assert tr[0] < tr[1] < 2 * tr[0] < 0.25 * tr[2]
