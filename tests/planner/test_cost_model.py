"""The analytic cost model, term by term, against hand computation.

A toy device with round rates (efficiencies set to 1, so rates are the device's) and
a toy model whose parameter counts are written out below from the architecture,
not from ModelSpec's helpers:

    L=4 layers, h=64, 4 heads of d=16, 2 KV heads, SwiGLU ffn=128, vocab 128 (padded 128)
    per layer, TP-split: QKV (4+2*2)*16=128 rows x 64 = 8192, proj 64x64 = 4096,
                         fc1 256x64 = 16384, fc2 64x128 = 8192      -> 36864
    per layer, replicated: two RMSNorms of 64                         -> 128
    embedding 128x64 = 8192; final norm 64; LM head 128x64 = 8192; value head 64
    P_mm (weights a token multiplies through, LM head) = 4*36864 + 8192 = 155648
    attention FLOPs per token per context token: 4*L*heads*d = 1024
"""
from __future__ import annotations

import math

import pytest

from planner.cluster import ClusterSpec, DeviceSpec, resolve_device
from planner.cost_config import CostModelConfig
from planner.cost_model import CostModel
from planner.graph import MFC
from planner.layout import Layout
from planner.mesh import DeviceMesh
from planner.model_spec import ModelSpec, model_presets
from planner.profile import MeasuredMFC, MeasuredRates, ProfileTable

pytestmark = pytest.mark.pure

R = 1e12          # FLOP/s
B_MEM = 1e11      # bytes/s
B_INTRA = 1e10
B_INTER = 1e9
LAT_INTRA = 1e-6
LAT_INTER = 1e-5

DEV = DeviceSpec(name="toy", peak_flops=R, mem_bytes=1e9, mem_bw_bytes_per_s=B_MEM,
                 intra_node_bytes_per_s=B_INTRA, inter_node_bytes_per_s=B_INTER,
                 intra_node_latency_s=LAT_INTRA, inter_node_latency_s=LAT_INTER)
EXACT = CostModelConfig(matmul_efficiency=1.0, mem_bw_efficiency=1.0, link_efficiency=1.0,
                        gemm_half_rows=0, gemm_half_width=0)   # no GEMM-size curve
TOY = ModelSpec(name="toy", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                vocab_size=128)

L, H, DT = 4, 64, 2
LAYER_SPLIT, LAYER_REPL, EMB, NORM, LM_HEAD = 36864, 128, 8192, 64, 8192
P_MM = 155648
ATTN = 1024


def flops_per_token(context: float) -> float:
    return 2 * P_MM + ATTN * context


def rs(nbytes: float, n: int, inter: bool = False) -> float:
    """Ring reduce-scatter (or all-gather): half the all-reduce's traffic and steps."""
    if n == 1:
        return 0.0
    bw, lat = (B_INTER, LAT_INTER) if inter else (B_INTRA, LAT_INTRA)
    return (n - 1) / n * nbytes / bw + math.ceil(math.log2(n)) * lat


def ar(nbytes: float, n: int, inter: bool = False) -> float:
    """Ring all-reduce, by the textbook formula."""
    if n == 1:
        return 0.0
    bw, lat = (B_INTER, LAT_INTER) if inter else (B_INTRA, LAT_INTRA)
    return 2 * (n - 1) / n * nbytes / bw + 2 * math.ceil(math.log2(n)) * lat


def act_per_token_layer(tp: int) -> float:
    # bf16: 5h replicated + (qkv rows 128 + attention out 64 + 3 x ffn 128) / tp
    return DT * (5 * H + (128 + 64 + 3 * 128) / tp)


def cost_model(n_nodes=1, gpn=4, config=EXACT, profile=None) -> CostModel:
    return CostModel(ClusterSpec(n_nodes=n_nodes, gpus_per_node=gpn, device=DEV), config,
                     profile)


def mfc(kind, n_seqs=8, prompt=16, gen=32, minibatches=1, epochs=1) -> MFC:
    return MFC(name=f"actor.{kind}", role="actor", kind=kind, n_seqs=n_seqs, prompt_len=prompt,
               gen_len=gen, input_keys=("d",), output_keys=("o",), n_minibatches=minibatches,
               n_epochs=epochs)


def mesh(n, first=0) -> DeviceMesh:
    return DeviceMesh(first_gpu=first, n_gpus=n)


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=0)


# ---- rates and collectives ------------------------------------------------------

def test_rates_are_device_rates_times_efficiency():
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=4, device=DEV))  # default config
    assert cm.flops_per_s == approx(0.5 * R)
    assert cm.mem_bytes_per_s == approx(0.8 * B_MEM)
    assert cm.intra_bytes_per_s == approx(0.8 * B_INTRA)
    assert cm.inter_bytes_per_s == approx(0.8 * B_INTER)
    assert cm.mem_limit_bytes == approx(0.9 * 1e9)


@pytest.mark.parametrize("n,inter,expected", [
    (1, False, 0.0),
    (2, False, 2 * 1 / 2 * 1e6 / B_INTRA + 2 * 1 * LAT_INTRA),
    (3, False, 2 * 2 / 3 * 1e6 / B_INTRA + 2 * 2 * LAT_INTRA),   # ceil(log2 3) = 2
    (8, False, 2 * 7 / 8 * 1e6 / B_INTRA + 2 * 3 * LAT_INTRA),
    (8, True, 2 * 7 / 8 * 1e6 / B_INTER + 2 * 3 * LAT_INTER),
])
def test_allreduce_s(n, inter, expected):
    assert cost_model().allreduce_s(1e6, n, inter) == approx(expected)


def test_p2p_s():
    cm = cost_model()
    assert cm.p2p_s(1e6, False) == approx(1e6 / B_INTRA + LAT_INTRA)
    assert cm.p2p_s(1e6, True) == approx(1e6 / B_INTER + LAT_INTER)


# ---- weights ---------------------------------------------------------------------

@pytest.mark.parametrize("tp,pp,head,expected", [
    (1, 1, "lm", 4 * (LAYER_SPLIT + LAYER_REPL) + EMB + NORM + LM_HEAD),
    (2, 1, "lm", 4 * (LAYER_SPLIT / 2 + LAYER_REPL) + EMB / 2 + NORM + LM_HEAD / 2),
    (1, 1, "value", 4 * (LAYER_SPLIT + LAYER_REPL) + EMB + NORM + H),
    # pp=2: first stage 2 layers + embedding, last 2 layers + norm + head; the heavier
    (2, 2, "lm", max(2 * (LAYER_SPLIT / 2 + LAYER_REPL) + EMB / 2,
                     2 * (LAYER_SPLIT / 2 + LAYER_REPL) + NORM + LM_HEAD / 2)),
    (1, 4, "value", 1 * (LAYER_SPLIT + LAYER_REPL) + EMB),
])
def test_stage_params(tp, pp, head, expected):
    assert CostModel.stage_params(TOY, head, Layout(tp=tp, pp=pp)) == approx(expected)


def test_tied_embeddings_count_once_without_pipeline_and_twice_with():
    tied = TOY.model_copy(update={"tied_embeddings": True})
    body = 4 * (LAYER_SPLIT + LAYER_REPL)
    assert CostModel.stage_params(tied, "lm", Layout()) == approx(body + EMB + NORM)
    # with pp=2 the last stage keeps its own copy of the embedding as the output layer
    half = 2 * (LAYER_SPLIT + LAYER_REPL)
    assert CostModel.stage_params(tied, "lm", Layout(pp=2)) == approx(half + NORM + EMB)


# ---- generate --------------------------------------------------------------------

def test_generate_single_gpu_is_memory_bound():
    c = cost_model().mfc_cost(mfc("generate"), TOY, "lm", mesh(1), Layout(), 1)
    weights = DT * (4 * (LAYER_SPLIT + LAYER_REPL) + EMB + NORM + LM_HEAD)   # 328832
    assert c.weights_bytes == approx(weights) and c.resident_bytes == approx(weights)
    # prefill: 8 x 16 prompt tokens, causal context 16/2
    assert c.terms_s["prefill"] == approx(8 * 16 * flops_per_token(8) / R)
    # decode: 32 steps; each reads the weights + the KV cache of 8 sequences at an
    # average context of 16 + 32/2; KV per token per layer = 2 x 2 heads x 16 x 2 bytes
    kv_read = 8 * L * (2 * 2 * 16 * DT) * 32
    mem_s = (weights + kv_read) / B_MEM
    assert 8 * flops_per_token(32) / R < mem_s          # memory-bound here
    assert c.terms_s["decode"] == approx(32 * 1 * mem_s)
    assert set(c.terms_s) == {"prefill", "decode"}
    assert c.time_s == approx(c.terms_s["prefill"] + c.terms_s["decode"])
    # memory: the KV cache of all 8 sequences at full length, fp32 logits of one step
    # (x2), and the prefill activations of one micro-batch
    kv_cache = 8 * L * (2 * 2 * 16 * DT) * (16 + 32)
    assert c.activation_bytes == approx(kv_cache + 4 * 8 * 128 * 2 + 8 * 16 * act_per_token_layer(1))


def test_generate_compute_bound_when_flops_are_scarce():
    slow = DEV.model_copy(update={"peak_flops": 1e9})
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=4, device=slow), EXACT)
    c = cm.mfc_cost(mfc("generate"), TOY, "lm", mesh(1), Layout(), 1)
    assert c.terms_s["decode"] == approx(32 * 8 * flops_per_token(32) / 1e9)


def test_generate_tp2_pp2_two_micro_batches():
    c = cost_model().mfc_cost(mfc("generate"), TOY, "lm", mesh(4), Layout(tp=2, pp=2), 2)
    weights = DT * max(2 * (LAYER_SPLIT / 2 + LAYER_REPL) + EMB / 2,
                       2 * (LAYER_SPLIT / 2 + LAYER_REPL) + NORM + LM_HEAD / 2)
    assert c.weights_bytes == approx(weights)
    b = 8 / 2                                   # sequences per micro-batch
    # prefill: per stage slot compute / (tp*pp), 2 TP all-reduces per layer of the
    # stage, one activation send to the next stage (intra-node); (m + pp - 1) slots
    tok = b * 16
    slot = (tok * flops_per_token(8) / (4 * R) + (L / 2) * 2 * ar(tok * H * DT, 2)
            + tok * H * DT / B_INTRA + LAT_INTRA)
    assert c.terms_s["prefill"] == approx((2 + 2 - 1) * slot)
    # decode: max(m, pp) = 2 slots per generated token
    kv_read = b * (L / 2) * (2 * 1 * 16 * DT) * 32
    mem_s = (weights + kv_read) / B_MEM
    assert b * flops_per_token(32) / (4 * R) < mem_s
    step = mem_s + (L / 2) * 2 * ar(b * H * DT, 2) + b * H * DT / B_INTRA + LAT_INTRA
    assert c.terms_s["decode"] == approx(32 * 2 * step)
    # both waves are in flight (one per stage): the KV cache of all 8 sequences, for
    # the stage's 2 layers and its 1 KV head, 48 positions
    assert c.activation_bytes == approx(2 * b * (L / 2) * (2 * 1 * 16 * DT) * 48
                                        + 4 * b * 64 * 2 + b * 16 * act_per_token_layer(2))


@pytest.mark.parametrize("pp,m,in_flight,groups", [
    (1, 1, 1, 1), (1, 4, 1, 4),        # pp 1: one wave at a time
    (2, 2, 2, 1), (2, 4, 2, 2),        # pp 2: two waves pipelined, groups in turn
    (4, 2, 2, 1)])                     # fewer waves than stages: bubbles
def test_generation_waves_trade_kv_memory_for_time(pp, m, in_flight, groups):
    """Generation runs its micro-batches as waves (the runtime's schedule):
    ``min(m, pp)`` waves in flight, ``ceil(m / min(m, pp))`` groups one after another;
    the KV cache holds the waves in flight; a group costs (in flight + pp - 1) prefill
    slots and pp decode slots per token."""
    c = cost_model().mfc_cost(mfc("generate"), TOY, "lm", mesh(pp), Layout(pp=pp), m)
    b = 8 / m
    kv_tok_layer = 2 * 2 * 16 * DT
    assert CostModel.kv_cache_bytes(cost_model(), TOY, mfc("generate"), Layout(pp=pp), m) == \
        approx(in_flight * b * (L / pp) * kv_tok_layer * 48)
    weights = c.weights_bytes
    tok = b * 16
    link = (tok * H * DT / B_INTRA + LAT_INTRA) if pp > 1 else 0.0
    prefill_slot = tok * flops_per_token(8) / (pp * R) + link
    assert c.terms_s["prefill"] == approx(groups * (in_flight + pp - 1) * prefill_slot)
    step = ((weights + b * (L / pp) * kv_tok_layer * 32) / B_MEM
            + ((b * H * DT / B_INTRA + LAT_INTRA) if pp > 1 else 0.0))
    assert c.terms_s["decode"] == approx(groups * 32 * pp * step)


def test_kv_cache_is_allocated_in_whole_blocks():
    """12 positions take one 16-position block; a 1-position block size counts exactly."""
    short = mfc("generate", prompt=8, gen=4)
    per_seq = L * (2 * 2 * 16 * DT)
    assert cost_model().kv_cache_bytes(TOY, short, Layout(), 1) == approx(8 * per_seq * 16)
    exact = cost_model(config=EXACT.model_copy(update={"kv_cache_block_tokens": 1}))
    assert exact.kv_cache_bytes(TOY, short, Layout(), 1) == approx(8 * per_seq * 12)


def test_decode_slots_follow_max_of_micro_batches_and_stages():
    cm = cost_model()
    one = cm.mfc_cost(mfc("generate"), TOY, "lm", mesh(4), Layout(pp=4), 1)
    four = cm.mfc_cost(mfc("generate"), TOY, "lm", mesh(4), Layout(pp=4), 4)
    # with pp=4, m=1 still pays 4 slots per token of a full-batch step; m=4 pays 4
    # slots of quarter-batch steps, so it is faster
    assert four.terms_s["decode"] < one.terms_s["decode"]


# ---- inference -------------------------------------------------------------------

def test_inference_tp2_pp2_across_nodes():
    cm = cost_model(n_nodes=2, gpn=2)          # the 4-GPU mesh spans 2 nodes
    c = cm.mfc_cost(mfc("inference"), TOY, "lm", mesh(4), Layout(tp=2, pp=2), 2)
    b, seq = 4, 48
    tok = b * seq
    compute = tok * flops_per_token(seq / 2) / (4 * R)
    tp_comm = (L / 2) * 2 * ar(tok * H * DT, 2)
    p2p = tok * H * DT / B_INTER + LAT_INTER           # a stage boundary crosses nodes
    assert c.terms_s["compute"] == approx(2 * compute)
    assert c.terms_s["tp_comm"] == approx(2 * tp_comm)
    assert c.terms_s["pp_comm"] == approx(2 * p2p)
    assert c.terms_s["pp_bubble"] == approx((2 - 1) * (compute + tp_comm + p2p))
    assert "dp_grad_sync" not in c.terms_s and "optimizer" not in c.terms_s
    assert c.time_s == approx(sum(c.terms_s.values()))
    # two layers' activations of one micro-batch and fp32 logits (x2) of its tokens
    assert c.activation_bytes == approx(2 * tok * act_per_token_layer(2) + 2 * 4 * tok * 64)
    assert c.resident_bytes == approx(c.weights_bytes)


def test_inference_data_parallel_splits_the_batch():
    cm = cost_model()
    one = cm.mfc_cost(mfc("inference"), TOY, "value", mesh(1), Layout(), 1)
    four = cm.mfc_cost(mfc("inference"), TOY, "value", mesh(4), Layout(dp=4), 1)
    assert one.terms_s["compute"] == approx(8 * 48 * (2 * (4 * LAYER_SPLIT + H) + ATTN * 24) / R)
    assert four.terms_s["compute"] == approx(one.terms_s["compute"] / 4)
    assert four.weights_bytes == approx(one.weights_bytes)


# ---- train -----------------------------------------------------------------------

@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("distributed", [True, False])
def test_train_tp2_dp2_across_nodes(recompute, distributed):
    cfg = EXACT.model_copy(update={"activation_recompute": recompute,
                                   "distributed_optimizer": distributed})
    cm = cost_model(n_nodes=2, gpn=2, config=cfg)
    m = mfc("train", n_seqs=16, minibatches=2, epochs=2)
    c = cm.mfc_cost(m, TOY, "lm", mesh(4), Layout(tp=2, dp=2), 2)
    steps = 2 * 2                              # mini-batches x epochs
    b = 16 / 2 / 2 / 2                         # per step, per replica, per micro-batch
    tok = b * 48
    passes = 4 if recompute else 3             # forward + 2x backward (+ recomputation)
    compute = passes * tok * flops_per_token(24) / (2 * R)
    n_ar = 6 if recompute else 4
    tp_comm = L * n_ar * ar(tok * H * DT, 2)
    p_gpu = 4 * (LAYER_SPLIT / 2 + LAYER_REPL) + EMB / 2 + NORM + LM_HEAD / 2
    assert c.terms_s["compute"] == approx(steps * 2 * compute)
    assert c.terms_s["tp_comm"] == approx(steps * 2 * tp_comm)
    assert c.terms_s["pp_comm"] == 0 and c.terms_s["pp_bubble"] == 0
    # DP groups are {0,2} and {1,3}: across the two nodes, so the NIC rate applies.
    # Gradients are reduced in fp32 (4 bytes); the distributed optimizer reduce-scatters
    # them and all-gathers the updated bf16 weights, the plain one all-reduces them.
    if distributed:
        sync = rs(4 * p_gpu, 2, inter=True) + rs(DT * p_gpu, 2, inter=True)
    else:
        sync = ar(4 * p_gpu, 2, inter=True)
    assert c.terms_s["dp_grad_sync"] == approx(steps * sync)
    shard = 2 if distributed else 1
    assert c.terms_s["optimizer"] == approx(steps * p_gpu / shard * 30 / B_MEM)
    assert c.weights_bytes == approx(DT * p_gpu)
    assert c.resident_bytes == approx(DT * p_gpu + p_gpu * (4 + 12 / shard))
    if recompute:   # each layer keeps its input; one layer's full activations at a time
        act = 1 * L * tok * H * DT + tok * act_per_token_layer(2)
    else:
        act = 1 * L * tok * act_per_token_layer(2)
    assert c.activation_bytes == approx(act + 2 * 4 * tok * 64)


def test_train_compute_is_three_forwards_and_four_with_recomputation():
    base = cost_model().mfc_cost(mfc("train"), TOY, "lm", mesh(1), Layout(), 1)
    rc = cost_model(config=EXACT.model_copy(update={"activation_recompute": True})).mfc_cost(
        mfc("train"), TOY, "lm", mesh(1), Layout(), 1)
    inf = cost_model().mfc_cost(mfc("inference"), TOY, "lm", mesh(1), Layout(), 1)
    assert base.terms_s["compute"] == approx(3 * inf.terms_s["compute"])
    assert rc.terms_s["compute"] == approx(4 * inf.terms_s["compute"])
    assert base.terms_s["dp_grad_sync"] == 0.0


def test_train_pipeline_bubble_and_activation_sends():
    cm = cost_model()
    c = cm.mfc_cost(mfc("train", n_seqs=8), TOY, "lm", mesh(4), Layout(pp=4), 4)
    tok = 2 * 48
    compute = 3 * tok * flops_per_token(24) / (4 * R)
    p2p = 2 * (tok * H * DT / B_INTRA + LAT_INTRA)       # forward and backward sends
    assert c.terms_s["compute"] == approx(4 * compute)
    assert c.terms_s["pp_comm"] == approx(4 * p2p)
    assert c.terms_s["pp_bubble"] == approx(3 * (compute + p2p))
    # 1F1B: min(pp, m) = 4 micro-batches in flight, one layer per stage
    assert c.activation_bytes == approx(4 * 1 * tok * act_per_token_layer(1) + 2 * 4 * tok * 128)


# ---- GEMM efficiency by size --------------------------------------------------------

CURVE = EXACT.model_copy(update={"matmul_efficiency": 0.5, "gemm_half_rows": 128.0,
                                 "gemm_half_width": 64.0})


@pytest.mark.parametrize("rows,tp", [(96, 1), (96, 2), (4096, 4), (1, 1)])
def test_gemm_rate_by_rows_and_sharded_width(rows, tp):
    # mean TP-sharded width of the four layer GEMMs: (128 + 64 + 256 + 128) / 4 / tp
    width = LAYER_SPLIT / (4 * H) / tp
    assert width == 144 / tp
    want = 0.5 * R * rows / (rows + 128) * width / (width + 64)
    assert cost_model(config=CURVE).gemm_rate(TOY, rows, tp) == approx(want)
    # either half-point at 0 switches its factor off
    rows_only = CURVE.model_copy(update={"gemm_half_width": 0.0})
    assert cost_model(config=rows_only).gemm_rate(TOY, rows, tp) == approx(0.5 * R * rows / (rows + 128))
    assert cost_model().gemm_rate(TOY, rows, tp) == approx(R)     # EXACT: no curve


def test_gemm_curve_prices_train_inference_prefill_and_decode():
    cm = cost_model(config=CURVE)
    lay = Layout(tp=2, dp=2)
    w = 144 / 2
    eff = lambda rows: 0.5 * R * rows / (rows + 128) * w / (w + 64)   # noqa: E731
    # train: 16 seqs / 2 mini-batches / dp 2 / 2 micro-batches = 2 seqs x 48 tokens
    tr = cm.mfc_cost(mfc("train", n_seqs=16, minibatches=2), TOY, "lm", mesh(4), lay, 2)
    tok = 2 * 48
    assert tr.terms_s["compute"] == approx(2 * 2 * 3 * tok * flops_per_token(24) / (2 * eff(tok)))
    inf = cm.mfc_cost(mfc("inference"), TOY, "lm", mesh(4), lay, 1)
    tok = 4 * 48
    assert inf.terms_s["compute"] == approx(tok * flops_per_token(24) / (2 * eff(tok)))
    # generate on one GPU with a scarce FLOP rate: prefill rows are the prompt tokens of
    # the micro-batch, decode rows the sequences of one step (compute-bound here)
    slow = DEV.model_copy(update={"peak_flops": 1e9})
    gm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=4, device=slow), CURVE)
    g = gm.mfc_cost(mfc("generate"), TOY, "lm", mesh(1), Layout(), 1)
    e1 = lambda rows: 0.5 * 1e9 * rows / (rows + 128) * 144 / (144 + 64)   # noqa: E731
    assert g.terms_s["prefill"] == approx(8 * 16 * flops_per_token(8) / e1(8 * 16))
    assert g.terms_s["decode"] == approx(32 * 8 * flops_per_token(32) / e1(8))


def test_gemm_curve_makes_small_micro_batches_cost_more():
    spec = model_presets()["llama2-7b"]
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g")))
    m = mfc("train", n_seqs=64)
    t = [cm.mfc_cost(m, spec, "lm", mesh(8), Layout(pp=8), mb).terms_s["compute"]
         for mb in (1, 4, 16, 64)]
    assert t == sorted(t) and t[-1] / t[0] > 1.2


# ---- monotonic sanity ------------------------------------------------------------

def test_more_tp_lowers_weights_per_gpu():
    spec = model_presets()["llama2-7b"]
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g")))
    m = mfc("inference", n_seqs=64)
    w = [cm.mfc_cost(m, spec, "lm", mesh(8), Layout(tp=tp, dp=8 // tp), 1).weights_bytes
         for tp in (1, 2, 4, 8)]
    assert w == sorted(w, reverse=True) and len(set(w)) == 4
    assert w[0] / w[3] > 7  # nearly everything is TP-split


def test_more_micro_batches_lowers_activation_memory():
    spec = model_presets()["llama2-7b"]
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("h100-80g")))
    for kind in ("train", "inference", "generate"):
        m = mfc(kind, n_seqs=64)
        acts = [cm.mfc_cost(m, spec, "lm", mesh(8), Layout(tp=8), mb).activation_bytes
                for mb in (1, 2, 4, 8)]
        assert acts == sorted(acts, reverse=True) and len(set(acts)) == 4, kind


# ---- profile table overrides ------------------------------------------------------

def test_profile_rates_override_device_rates():
    rates = MeasuredRates(matmul_flops_per_s=2e12, mem_bytes_per_s=4e11,
                          intra_node_bytes_per_s=3e10, inter_node_bytes_per_s=5e9)
    cm = cost_model(config=CostModelConfig(gemm_half_rows=0, gemm_half_width=0),
                    profile=ProfileTable(device="toy", rates=rates))
    assert (cm.flops_per_s, cm.mem_bytes_per_s, cm.intra_bytes_per_s, cm.inter_bytes_per_s) == (
        2e12, 4e11, 3e10, 5e9)   # measured rates are used as they are, no efficiency
    c = cm.mfc_cost(mfc("inference"), TOY, "lm", mesh(1), Layout(), 1)
    assert c.terms_s["compute"] == approx(8 * 48 * flops_per_token(24) / 2e12)
    assert cm.allreduce_s(1e6, 2, False) == approx(1e6 / 3e10 + 2 * LAT_INTRA)


def test_profile_partial_rates_keep_the_rest_analytic():
    cm = cost_model(config=CostModelConfig(),
                    profile=ProfileTable(device="toy", rates=MeasuredRates(mem_bytes_per_s=4e11)))
    assert cm.mem_bytes_per_s == 4e11
    assert cm.flops_per_s == approx(0.5 * R)
    assert cm.intra_bytes_per_s == approx(0.8 * B_INTRA)


def test_profile_exact_mfc_time_overrides_only_its_match():
    entry = MeasuredMFC(model="toy", kind="inference", tp=2, pp=1, dp=2, micro_batches=2,
                        n_seqs=8, prompt_len=16, gen_len=32, time_s=0.125)
    cm = cost_model(profile=ProfileTable(device="toy", mfcs=(entry,)))
    plain = cost_model()
    lay = Layout(tp=2, dp=2)
    hit = cm.mfc_cost(mfc("inference"), TOY, "lm", mesh(4), lay, 2)
    assert hit.time_s == 0.125 and hit.terms_s == {"measured": 0.125}
    ref = plain.mfc_cost(mfc("inference"), TOY, "lm", mesh(4), lay, 2)
    assert hit.activation_bytes == ref.activation_bytes  # memory stays analytic
    # other micro-batches, layouts, kinds or shapes fall back to the analytic model
    for args in ((mfc("inference"), lay, 1), (mfc("inference"), Layout(tp=4), 2),
                 (mfc("train"), lay, 2), (mfc("inference", n_seqs=16), lay, 2)):
        got = cm.mfc_cost(args[0], TOY, "lm", mesh(4), args[1], args[2])
        want = plain.mfc_cost(args[0], TOY, "lm", mesh(4), args[1], args[2])
        assert got.time_s == want.time_s and "measured" not in got.terms_s


def test_fixed_overheads_per_layer_call_and_micro_batch():
    """Each micro-batch slot pays passes x layers/pp x layer_overhead_s + microbatch_overhead_s,
    and decoding pays layers/pp x layer_overhead_s per slot and token."""
    from planner.algorithms import BatchShape, build_graph
    from planner.cluster import ClusterSpec, DeviceSpec
    from planner.cost_model import CostModel
    from planner.layout import Layout
    from planner.mesh import DeviceMesh
    from planner.model_spec import model_presets

    base = dict(name="d", peak_flops=1e14, mem_bytes=8e10, mem_bw_bytes_per_s=1e12,
                intra_node_bytes_per_s=1e11, inter_node_bytes_per_s=1e10)
    plain = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=4, device=DeviceSpec(**base)))
    slow = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=4, device=DeviceSpec(
        **base, layer_overhead_s=0.01, microbatch_overhead_s=0.1)))
    spec = model_presets()["tiny-llama-8l"]
    g = build_graph("grpo", BatchShape(prompts_per_step=8, samples_per_prompt=2, prompt_len=8,
                                       gen_len=5, ppo_minibatches=2), {"actor", "ref"})
    gen, ref, train = g.mfcs
    mesh, lay = DeviceMesh(first_gpu=0, n_gpus=4), Layout(tp=1, pp=2, dp=2)
    m = 2
    d_train = (slow.mfc_cost(train, spec, "lm", mesh, lay, m).time_s
               - plain.mfc_cost(train, spec, "lm", mesh, lay, m).time_s)
    # 2 optimizer steps x (m + pp - 1) slots x (3 passes x 8/2 layers x 0.01 + 0.1)
    assert abs(d_train - 2 * (m + 1) * (3 * 4 * 0.01 + 0.1)) < 1e-9
    d_ref = (slow.mfc_cost(ref, spec, "lm", mesh, lay, m).time_s
             - plain.mfc_cost(ref, spec, "lm", mesh, lay, m).time_s)
    assert abs(d_ref - (m + 1) * (1 * 4 * 0.01 + 0.1)) < 1e-9
    d_gen = (slow.mfc_cost(gen, spec, "lm", mesh, lay, m).time_s
             - plain.mfc_cost(gen, spec, "lm", mesh, lay, m).time_s)
    # prefill: (m + pp - 1) slots x (4 x 0.01 + 0.1); decode: 5 tokens x max(m, pp) x 4 x 0.01
    assert abs(d_gen - ((m + 1) * (4 * 0.01 + 0.1) + 5 * 2 * 4 * 0.01)) < 1e-9
