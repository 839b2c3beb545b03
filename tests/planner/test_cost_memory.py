"""The cost model's memory per GPU against hand computation: weights of the heaviest
pipeline stage, the training state that stays resident, activations, and the KV cache
of the generation waves in flight.

Toy model (as in test_cost_model.py), counted by hand:

    L=4 layers, h=64, 4 heads of d=16, 2 KV heads, SwiGLU ffn=128, vocab 128
    per layer, TP-split 36864 (QKV 8192, proj 4096, fc1 16384, fc2 8192); replicated 128
    embedding 8192; final norm 64; LM head 8192; value head 64
    stored activations per token and layer (bf16): 5h replicated + (QKV rows 128 +
        attention out 64 + 3 x ffn 128) / tp = 2 x (320 + 576 / tp) bytes
    KV cache per token and layer (bf16): K and V x 2 heads x 16 x 2 bytes = 128 bytes
"""
from __future__ import annotations

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, DeviceSpec
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec

pytestmark = pytest.mark.pure

DEV = DeviceSpec(name="toy", peak_flops=1e12, mem_bytes=1e9, mem_bw_bytes_per_s=1e12,
                 intra_node_bytes_per_s=1e10, inter_node_bytes_per_s=1e9)
EXACT = CostModelConfig(matmul_efficiency=1.0, mem_bw_efficiency=1.0, link_efficiency=1.0,
                        gemm_half_width=0)
TOY = ModelSpec(name="toy", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                vocab_size=128)

L, H, DT = 4, 64, 2
SPLIT, REPL, EMB, NORM, LM_HEAD = 36864, 128, 8192, 64, 8192
KV_TOK_LAYER = 2 * 2 * 16 * DT                  # 128 bytes


def act(tp: int) -> float:
    return DT * (5 * H + (128 + 64 + 3 * 128) / tp)


def cost_model(config=EXACT) -> CostModel:
    return CostModel(ClusterSpec(n_nodes=1, gpus_per_node=8, device=DEV), config)


def mfc(kind, n_seqs=8, prompt=16, gen=32, minibatches=1) -> MFC:
    return MFC(name=f"actor.{kind}", role="actor", kind=kind, n_seqs=n_seqs, prompt_len=prompt,
               gen_len=gen, input_keys=("d",), output_keys=("o",), n_minibatches=minibatches)


def mesh(n) -> DeviceMesh:
    return DeviceMesh(first_gpu=0, n_gpus=n)


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=0)


def test_usable_memory():
    assert cost_model().mem_limit_bytes == approx(0.9e9)


# ---- weights ---------------------------------------------------------------------------

@pytest.mark.parametrize("tp,pp,head,expected", [
    (1, 1, "lm", 4 * (SPLIT + REPL) + EMB + NORM + LM_HEAD),             # 164416
    (2, 1, "lm", 4 * (SPLIT / 2 + REPL) + EMB / 2 + NORM + LM_HEAD / 2),  # 82496
    (1, 1, "value", 4 * (SPLIT + REPL) + EMB + NORM + H),
    # pp=2: first stage 2 layers + embedding, last 2 layers + norm + head: the heavier
    (2, 2, "lm", 2 * (SPLIT / 2 + REPL) + NORM + LM_HEAD / 2),
    (1, 4, "value", 1 * (SPLIT + REPL) + EMB),
])
def test_stage_params(tp, pp, head, expected):
    assert CostModel.stage_params(TOY, head, Layout(tp=tp, pp=pp)) == approx(expected)


def test_tied_embeddings_count_once_without_pipeline_and_twice_with():
    tied = TOY.model_copy(update={"tied_embeddings": True})
    assert CostModel.stage_params(tied, "lm", Layout()) == approx(4 * (SPLIT + REPL) + EMB + NORM)
    # with pp=2 the last stage keeps its own copy of the embedding as the output layer
    assert CostModel.stage_params(tied, "lm", Layout(pp=2)) == approx(
        2 * (SPLIT + REPL) + NORM + EMB)


# ---- inference and generation ---------------------------------------------------------------

def test_inference_memory():
    c = cost_model().mfc_cost(mfc("inference"), TOY, "lm", mesh(2), Layout(tp=2), 2)
    weights = DT * 82496
    assert c.weights_bytes == approx(weights) and c.resident_bytes == approx(weights)
    tok = 4 * 48                                 # one micro-batch: 4 sequences of 48
    # two layers' activations and fp32 logits (x2) of this rank's 64 vocabulary columns
    assert c.activation_bytes == approx(2 * tok * act(2) + 2 * 4 * tok * 64)


def test_generate_memory_one_gpu():
    c = cost_model().mfc_cost(mfc("generate"), TOY, "lm", mesh(1), Layout(), 1)
    assert c.resident_bytes == approx(DT * 164416)
    # the cache of all 8 sequences at 16 + 32 = 48 positions (3 whole blocks), the fp32
    # logits of one step (x2), one layer's activations of the 8 x 16 prompt tokens
    assert c.activation_bytes == approx(8 * L * KV_TOK_LAYER * 48 + 4 * 8 * 128 * 2
                                        + 8 * 16 * act(1))


@pytest.mark.parametrize("pp,m,in_flight", [
    (1, 1, 1), (1, 4, 1),       # pp 1: one wave at a time
    (2, 2, 2), (2, 4, 2),       # pp 2: two waves in flight
    (4, 2, 2)])                 # fewer waves than stages
def test_kv_cache_holds_the_waves_in_flight(pp, m, in_flight):
    b = 8 / m                   # sequences per wave
    want = in_flight * b * (L / pp) * KV_TOK_LAYER * 48
    cm = cost_model()
    assert cm.kv_cache_bytes(TOY, mfc("generate"), Layout(pp=pp), m) == approx(want)
    c = cm.mfc_cost(mfc("generate"), TOY, "lm", mesh(pp), Layout(pp=pp), m)
    assert c.activation_bytes == approx(want + 4 * b * 128 * 2 + b * 16 * act(1))


def test_kv_cache_with_tp_and_dp():
    # TP2 halves the KV heads (1 each); DP2 halves the sequences (4 per replica)
    got = cost_model().kv_cache_bytes(TOY, mfc("generate"), Layout(tp=2, dp=2), 1)
    assert got == approx(4 * L * (2 * 1 * 16 * DT) * 48)


def test_kv_cache_docstring_example():
    """2 layers, 2 KV heads of 16, fp32, 64 sequences at dp 1 in 2 waves, 8 + 4 tokens
    (one 16-token block): 32 x 2 x (2 x 2 x 16 x 4) x 16 = 262144 bytes."""
    spec = ModelSpec(name="kv", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2,
                     ffn_hidden=128, vocab_size=128)
    cm = cost_model(EXACT.model_copy(update={"param_dtype_bytes": 4}))
    assert cm.kv_cache_bytes(spec, mfc("generate", n_seqs=64, prompt=8, gen=4), Layout(),
                             2) == 262144


def test_kv_cache_is_allocated_in_whole_blocks():
    """12 positions take one 16-position block; a 1-position block counts exactly."""
    short = mfc("generate", prompt=8, gen=4)
    per_seq_pos = L * KV_TOK_LAYER
    assert cost_model().kv_cache_bytes(TOY, short, Layout(), 1) == approx(8 * per_seq_pos * 16)
    exact = cost_model(EXACT.model_copy(update={"kv_cache_block_tokens": 1}))
    assert exact.kv_cache_bytes(TOY, short, Layout(), 1) == approx(8 * per_seq_pos * 12)


# ---- training --------------------------------------------------------------------------

@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("distributed", [True, False])
def test_train_memory_tp2_dp2(recompute, distributed):
    cfg = EXACT.model_copy(update={"distributed_optimizer": distributed})
    m = mfc("train", n_seqs=16, minibatches=2)
    c = cost_model(cfg).mfc_cost(m, TOY, "lm", mesh(4), Layout(tp=2, dp=2), 2,
                                 recompute=recompute)
    p = 82496
    shard = 2 if distributed else 1
    assert c.weights_bytes == approx(DT * p)
    # + fp32 main grads (4 B) + fp32 master weight, Adam m and v (12 B, over DP if sharded)
    assert c.resident_bytes == approx(DT * p + p * (4 + 12 / shard))
    tok = 2 * 48                 # 16 / 2 mini-batches / 2 replicas / 2 micro-batches
    if recompute:                # each layer keeps its input; one layer's full set at a time
        a = 1 * L * tok * H * DT + tok * act(2)
    else:                        # pp 1: one micro-batch in flight, all 4 layers
        a = 1 * L * tok * act(2)
    assert c.activation_bytes == approx(a + 2 * 4 * tok * 64)


def test_train_memory_pp2_holds_two_micro_batches_in_flight():
    c = cost_model().mfc_cost(mfc("train"), TOY, "lm", mesh(2), Layout(pp=2), 4)
    p = 2 * (SPLIT + REPL) + NORM + LM_HEAD         # the last stage is the heavier
    assert c.resident_bytes == approx(DT * p + p * (4 + 12))
    tok = 2 * 48
    # 1F1B: min(pp, m) = 2 micro-batches in flight on the first stage, 2 layers each
    assert c.activation_bytes == approx(2 * 2 * tok * act(1) + 2 * 4 * tok * 128)
