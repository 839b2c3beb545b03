"""planner.cost.engine_terms (one micro-batch through one pipeline stage) and the two ways
the cost model composes stages (pipelined, decode_iteration), against hand computation.

Toy device: 1e12 FLOP/s and 1e12 B/s of memory (so a GEMM of two or more rows of
this model is compute-bound), NVLink 1e10 B/s, NIC 1e9 B/s, latency 1 us / 10 us;
every efficiency 1 and no width curve. Toy model, counted by hand:

    L=4 layers, h=64, 4 heads of d=16, 2 KV heads, SwiGLU ffn=128, vocab 128
    per layer GEMMs (K, N) at TP1: QKV (64, (4+2*2)*16=128), proj (64, 64),
        fc1 (64, 2*128=256), fc2 (128, 64); sum K*N = 8192+4096+16384+8192 = 36864,
        sum (K+N) = 192+128+320+192 = 832
    at TP2: QKV (64, 64), proj (32, 64), fc1 (64, 128), fc2 (64, 64); sum K*N = 18432
    LM head (64, 128 / tp); value head (64, 1)
    attention per layer and head: [rows, 16] x [16, ctx] and [rows, ctx] x [ctx, 16],
        2 x 2 x rows x 16 x ctx FLOPs
"""
from __future__ import annotations

import math

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.engine_terms import Work, expected_max_normal, lagged, layer_gemms, rank_lag, stage_pass
from planner.cost.passes import decode_iteration, pipelined
from planner.cost.profile import EngineCosts
from planner.cost.rates import Rates
from planner.specs.cluster import ClusterSpec, DeviceSpec
from planner.specs.model_spec import ModelSpec

pytestmark = pytest.mark.pure

R, B_MEM, B_INTRA, B_INTER = 1e12, 1e12, 1e10, 1e9
LAT_INTRA, LAT_INTER = 1e-6, 1e-5
DEV = DeviceSpec(name="toy", peak_flops=R, mem_bytes=1e9, mem_bw_bytes_per_s=B_MEM,
                 intra_node_bytes_per_s=B_INTRA, inter_node_bytes_per_s=B_INTER,
                 intra_node_latency_s=LAT_INTRA, inter_node_latency_s=LAT_INTER)
EXACT = CostModelConfig(matmul_efficiency=1.0, mem_bw_efficiency=1.0, link_efficiency=1.0,
                        gemm_half_width=0)
TOY = ModelSpec(name="toy", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                vocab_size=128)


def rates(device=DEV) -> Rates:
    return Rates(ClusterSpec(n_nodes=2, gpus_per_node=4, device=device), EXACT)


def ar2(nbytes: float) -> float:
    """All-reduce over 2 ranks of one node: 2 x 1/2 x S / 1e10 + 2 x 1 us."""
    return nbytes / B_INTRA + 2 * LAT_INTRA


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=0)


# ---- Work -------------------------------------------------------------------------------

def test_work_adds_seconds_and_counts_and_prices_the_counts():
    a = Work(seconds={"gemm": 1.0}, counts={"layer_s": 2.0})
    b = Work(seconds={"gemm": 0.5, "tp_comm": 0.25}, counts={"layer_s": 1.0, "call_s": 1.0})
    a.add(b, 3)
    assert a.seconds == {"gemm": 2.5, "tp_comm": 0.75}
    assert a.counts == {"layer_s": 5.0, "call_s": 3.0}
    costs = EngineCosts(layer_s=0.1, call_s=1.0, microbatch_s=100.0)
    assert a.fixed_s(costs) == approx(0.5 + 3.0)
    assert a.total(costs) == approx(2.5 + 0.75 + 3.5)
    assert a.terms(costs) == {"gemm": 2.5, "tp_comm": 0.75, "fixed": approx(3.5)}


def test_layer_gemms_by_hand():
    assert layer_gemms(TOY, 1) == [(64, 128), (64, 64), (64, 256), (128, 64)]
    assert layer_gemms(TOY, 2) == [(64, 64), (32, 64), (64, 128), (64, 64)]
    assert sum(k * n for k, n in layer_gemms(TOY, 1)) == 36864


# ---- one stage, one micro-batch -----------------------------------------------------------

def test_inference_whole_model_on_one_gpu():
    # 2 sequences of 48 tokens: 96 rows, causal context 24 on average
    w = stage_pass(rates(), TOY, "lm", "inference", 96, 24, 96, 1, 4, True, True)
    assert w.seconds["gemm"] == approx(2 * 96 * (4 * 36864 + 64 * 128) / R)
    assert w.seconds["attention"] == approx(4 * 4 * 2 * (2 * 96 * 16 * 24) / R)
    assert w.seconds["tp_comm"] == 0.0
    # the causal scores each head masks and softmaxes: 96 queries x 24 keys on average
    # and the kernels' extra time per second of GEMMs and attention
    assert w.counts == {"microbatch_s": 1, "layer_s": 4, "token_hidden_s": 4 * 96 * 64,
                        "token_s": 96, "token_vocab_s": 96 * 128, "collective_s": 0,
                        "score_s": 4 * 4 * 96 * 24,
                        "kernel_extra": approx(w.seconds["gemm"] + w.seconds["attention"])}


def test_train_tp2_counts_four_all_reduces_per_layer_and_the_heads():
    w = stage_pass(rates(), TOY, "lm", "train", 96, 24, 96, 2, 4, True, True)
    # forward + backward: 6 FLOPs per multiply-add; TP halves every layer GEMM and the head
    assert w.seconds["gemm"] == approx(6 * 96 * (4 * 18432 + 64 * 64) / R)
    assert w.seconds["attention"] == approx(3 * 4 * 2 * 2 * (2 * 96 * 16 * 24) / R)
    # 4 x 4 layers + 1 (embedding) all-reduces of 96 x 64 bf16 activations, and the
    # vocab-parallel log-probs' 3 all-reduces of one fp32 value per token
    assert w.seconds["tp_comm"] == approx(17 * ar2(96 * 64 * 2) + 3 * ar2(96 * 4))
    assert w.counts["collective_s"] == 20
    assert w.counts["token_vocab_s"] == 96 * 64       # this rank's half of the vocabulary
    assert w.counts["token_hidden_s"] == 4 * 96 * 64
    assert w.counts["score_s"] == 4 * 2 * 96 * 24     # this rank's 2 of the 4 heads


def test_prefill_last_stage_gathers_the_newest_logits():
    # 2 prompts of 16 tokens on the last of two stages (2 layers), TP2; the head sees
    # each row's newest position only (2 rows), gathered over TP, sampled on 128 columns
    w = stage_pass(rates(), TOY, "lm", "prefill", 32, 8, 2, 2, 2, False, True)
    assert w.seconds["gemm"] == approx((2 * 32 * 2 * 18432 + 2 * 2 * 64 * 64) / R)
    assert w.seconds["attention"] == approx(2 * 2 * 2 * (2 * 32 * 16 * 8) / R)
    assert w.seconds["tp_comm"] == approx(2 * 2 * ar2(32 * 64 * 2)
                                          + (0.5 * 2 * 128 * 2 / B_INTRA + LAT_INTRA))
    assert w.counts == {"microbatch_s": 1, "layer_s": 2, "token_hidden_s": 2 * 32 * 64,
                        "token_s": 32, "token_vocab_s": 2 * 128, "collective_s": 5,
                        "score_s": 0,        # generation's scores are not counted
                        "kernel_extra": approx(w.seconds["gemm"] + w.seconds["attention"])}


def test_decode_reads_its_kv_cache_and_streams_its_weights():
    slow = DEV.model_copy(update={"mem_bw_bytes_per_s": 1e10})     # 100 FLOPs per byte
    # 4 sequences, one new token each, 100 cached keys, a middle stage of 2 layers
    w = stage_pass(rates(slow), TOY, "lm", "decode", 4, 100, 4, 1, 2, False, False)
    # every GEMM memory-bound: (K N + rows (K + N)) bf16 per GEMM
    assert w.seconds["gemm"] == approx(2 * (36864 + 4 * 832) * 2 / 1e10)
    # attention: its GEMMs read (16 x 100 + 4 x 116) x 2 bytes each (memory-bound), but
    # the cache is more: 4 rows x 100 keys x K and V x 2 heads x 16 x 2 bytes per layer
    gemms = 2 * 4 * 2 * (16 * 100 + 4 * 116) * 2 / 1e10
    cache = 2 * 4 * 100 * 2 * 2 * 16 * 2 / 1e10
    assert cache > gemms
    assert w.seconds["attention"] == approx(cache)
    assert w.counts == {"microbatch_s": 1, "layer_s": 2, "token_hidden_s": 2 * 4 * 64,
                        "token_s": 4, "token_vocab_s": 0, "collective_s": 0, "score_s": 0,
                        "kernel_extra": approx(w.seconds["gemm"] + w.seconds["attention"])}


def test_value_head_is_one_memory_bound_column():
    w = stage_pass(rates(), TOY, "value", "inference", 96, 24, 96, 2, 4, True, True)
    # [96, 64] x [64, 1]: 12288 FLOPs but (64 + 96 x 65) x 2 = 12608 bytes
    assert w.seconds["gemm"] == approx((2 * 96 * 4 * 18432 + 12608) / R)
    # 2 x 4 layers + the embedding's all-reduce; no vocabulary collectives
    assert w.seconds["tp_comm"] == approx(9 * ar2(96 * 64 * 2))
    assert w.counts["collective_s"] == 9 and w.counts["token_vocab_s"] == 0


def test_tp_group_across_nodes_uses_the_nic():
    w = stage_pass(rates(), TOY, "lm", "inference", 96, 24, 96, 2, 4, False, False,
                   tp_nodes=2)
    # one rank per node: 2 x 1/2 x S / 1e9 + 2 x 1 x 10 us, 2 per layer
    assert w.seconds["tp_comm"] == approx(8 * (96 * 64 * 2 / B_INTER + 2 * LAT_INTER))


# ---- composing stages ---------------------------------------------------------------------

COSTS = EngineCosts(layer_s=0.5)


def test_pipelined_first_crossing_then_the_slowest_stage():
    first = Work(seconds={"gemm": 1.0}, counts={"layer_s": 2.0})      # 1 + 2 x 0.5 = 2
    middle = Work(seconds={"gemm": 3.0})                                # 3: the slowest
    out = pipelined([(first, 1), (middle, 2)], 4, COSTS)
    # crossing: 1 + 2 x 3 = 7 s of gemm, 2 layers; then 3 more micro-batches at 3 s
    assert out.seconds == {"gemm": 7.0 + 9.0}
    assert out.counts == {"layer_s": 2.0}
    assert out.total(COSTS) == 17.0


def test_pipeline_pace_includes_fixed_costs():
    heavy = Work(seconds={"gemm": 1.0}, counts={"layer_s": 10.0})     # 1 + 5 = 6 s
    light = Work(seconds={"gemm": 3.0})
    out = pipelined([(heavy, 1), (light, 1)], 3, COSTS)
    assert out.seconds == {"gemm": 4.0 + 2 * 1.0} and out.counts == {"layer_s": 30.0}
    assert out.total(COSTS) == 6 + 3 + 2 * 6
    assert pipelined([(light, 1)], 1, COSTS).total(COSTS) == 3.0


def test_decode_reads_its_kv_cache_at_the_kv_read_rate_and_its_weights_at_the_streaming_one():
    slow = DEV.model_copy(update={"mem_bw_bytes_per_s": 1e10, "kv_read_bw_efficiency": 0.5})
    w = stage_pass(rates(slow), TOY, "lm", "decode", 4, 100, 4, 1, 2, False, False)
    # the weights as above (EXACT streams at the full 1e10); the cache at half of it
    assert w.seconds["gemm"] == approx(2 * (36864 + 4 * 832) * 2 / 1e10)
    assert w.seconds["attention"] == approx(2 * 4 * 100 * 2 * 2 * 16 * 2 / 0.5e10)
    # a scoring pass does not read a cache: the rate does not change it
    plain = stage_pass(rates(DEV.model_copy(update={"mem_bw_bytes_per_s": 1e10})), TOY, "lm",
                       "inference", 4, 100, 4, 1, 2, False, False)
    assert stage_pass(rates(slow), TOY, "lm", "inference", 4, 100, 4, 1, 2, False,
                      False).seconds == plain.seconds


def test_decode_step_is_one_crossing_or_g_passes_of_the_slowest():
    a = Work(seconds={"gemm": 1.0})
    b = Work(seconds={"gemm": 2.0})
    # one wave: it crosses both stages (3 s); two waves: the slow stage serves both (4 s)
    assert decode_iteration([(a, 1), (b, 1)], 1, COSTS).seconds == {"gemm": 3.0}
    assert decode_iteration([(a, 1), (b, 1)], 2, COSTS).seconds == {"gemm": 4.0}
    # equal stages (4 of them): 2 waves still wait for the 4-stage crossing
    assert decode_iteration([(a, 4)], 2, COSTS).seconds == {"gemm": 4.0}
    assert decode_iteration([(a, 4)], 4, COSTS).seconds == {"gemm": 4.0}


# ---- the ranks' lag ---------------------------------------------------------------------

def test_expected_max_of_normals_by_hand():
    # 2: E max(X, Y) = E|X - Y| / 2 = 1/sqrt(pi); 3: 3/(2 sqrt(pi)); 4: a table's 1.02938
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-6)
    assert expected_max_normal(4) == pytest.approx(1.029375, rel=1e-5)
    assert rank_lag(1) == 0.0 and rank_lag(2) == pytest.approx(1.0)
    assert rank_lag(3) == pytest.approx(1.5, rel=1e-6)
    assert rank_lag(8) > rank_lag(4) > rank_lag(2)


def test_lagged_counts_the_gemm_and_attention_seconds_of_several_ranks():
    w = Work(seconds={"gemm": 0.03, "attention": 0.01, "tp_comm": 0.5, "dp_comm": 0.2},
             counts={"layer_s": 4.0})
    assert "lag" not in lagged(Work(seconds=dict(w.seconds)), 1).counts
    two = lagged(Work(seconds=dict(w.seconds), counts=dict(w.counts)), 2)
    assert two.counts == {"layer_s": 4.0, "lag": approx(0.04)}
    # priced: lag 0.1 per second of work -> 4 ms more on 2 ranks
    assert two.total(EngineCosts(lag=0.1)) - 0.74 == pytest.approx(0.004)
    # on 3 ranks 1.5x the count (E max of 3 normals / E max of 2)
    three = lagged(Work(seconds=dict(w.seconds)), 3)
    assert three.counts["lag"] == pytest.approx(0.06, rel=1e-6)
