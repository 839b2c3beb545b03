"""The cost model's MFC times, term by term, against hand computation.

(Memory is in test_cost_memory.py; one stage's pass and the stage composition in
test_engine_terms.py; rates in test_rates.py.)

A toy device with round rates, every efficiency 1 and no GEMM width curve: 1e12 FLOP/s
and 1e12 B/s of memory (so every GEMM of two or more rows of this model is
compute-bound and a GEMM's time is its FLOPs / 1e12), NVLink 1e10 B/s, NIC 1e9 B/s,
latency 1 us / 10 us; fixed costs: call 1 ms, micro-batch 100 us, layer 10 us (x3 in
training), decode layer 20 us; per token x hidden x layer 20 bf16 passes = 40 B
(4e-11 s, x3 in training), per output row x vocabulary column 3 fp32 passes = 12 B
(1.2e-11 s, x2 in training), per parameter in training (30 + 4) B = 3.4e-11 s.

A toy model whose parameter counts are written out from the architecture:

    L=4 layers, h=64, 4 heads of d=16, 2 KV heads, SwiGLU ffn=128, vocab 128 (padded 128)
    per layer, TP-split: QKV (4+2*2)*16=128 x 64 = 8192, proj 64x64 = 4096,
                         fc1 256x64 = 16384, fc2 64x128 = 8192      -> 36864
    per layer, replicated: two RMSNorms of 64                         -> 128
    embedding 128x64 = 8192; final norm 64; LM head 128x64 = 8192; value head 64
    P (one GPU, TP1 PP1, LM head) = 4*(36864+128) + 8192 + 64 + 8192 = 164416
    forward GEMM FLOPs per token: 2 x (4*36864 + 8192) = 2 x 155648
    attention FLOPs per token per context key: 4 x L x heads x d = 1024
"""
from __future__ import annotations

import pytest

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.profile import EngineCosts, ProfileTable
from planner.graph.dataflow import MFC
from planner.graph.lengths import GenLengths
from planner.specs.cluster import ClusterSpec, DeviceSpec
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec

pytestmark = pytest.mark.pure

R, B_MEM, B_INTRA, B_INTER = 1e12, 1e12, 1e10, 1e9
LAT_INTRA, LAT_INTER = 1e-6, 1e-5
DEV = DeviceSpec(name="toy", peak_flops=R, mem_bytes=1e9, mem_bw_bytes_per_s=B_MEM,
                 intra_node_bytes_per_s=B_INTRA, inter_node_bytes_per_s=B_INTER,
                 intra_node_latency_s=LAT_INTRA, inter_node_latency_s=LAT_INTER,
                 call_overhead_s=1e-3, microbatch_overhead_s=1e-4, layer_overhead_s=1e-5,
                 decode_layer_overhead_s=2e-5)
EXACT = CostModelConfig(matmul_efficiency=1.0, mem_bw_efficiency=1.0, link_efficiency=1.0,
                        gemm_half_width=0)
TOY = ModelSpec(name="toy", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                vocab_size=128)

L, H, DT = 4, 64, 2
SPLIT, P_TP1 = 36864, 164416
HID_S, VOCAB_S = 4e-11, 1.2e-11               # inference, prefill, decode
HID_S_TRAIN, VOCAB_S_TRAIN, PARAM_S = 1.2e-10, 2.4e-11, 3.4e-11


def ar(nbytes: float, n: int = 2) -> float:
    """Ring all-reduce within a node, by the textbook formula."""
    steps = {2: 1, 4: 2, 8: 3}[n]
    return 2 * (n - 1) / n * nbytes / B_INTRA + 2 * steps * LAT_INTRA


def ag2(nbytes: float) -> float:
    """All-gather (or reduce-scatter) over 2 ranks of a node."""
    return 0.5 * nbytes / B_INTRA + LAT_INTRA


def p2p(nbytes: float, inter: bool = False) -> float:
    return nbytes / (B_INTER if inter else B_INTRA) + (LAT_INTER if inter else LAT_INTRA)


def cost_model(n_nodes=1, gpn=4, config=EXACT, engines=None) -> CostModel:
    profile = ProfileTable(device="toy", engines=engines) if engines else None
    return CostModel(ClusterSpec(n_nodes=n_nodes, gpus_per_node=gpn, device=DEV), config,
                     profile)


def mfc(kind, n_seqs=8, prompt=16, gen=32, minibatches=1, epochs=1, lengths=None) -> MFC:
    return MFC(name=f"actor.{kind}", role="actor", kind=kind, n_seqs=n_seqs, prompt_len=prompt,
               gen_len=gen, input_keys=("d",), output_keys=("o",), n_minibatches=minibatches,
               n_epochs=epochs, lengths=lengths)


def mesh(n) -> DeviceMesh:
    return DeviceMesh(first_gpu=0, n_gpus=n)


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=0)


def check(terms: dict[str, float], expected: dict[str, float]) -> None:
    assert set(terms) == set(expected)
    for k, v in expected.items():
        assert terms[k] == approx(v), k


#: distinct round fixed costs, to read the counts back from the "fixed" term
ENGINE = EngineCosts(call_s=1.0, microbatch_s=0.1, layer_s=0.01, token_s=1e-6, param_s=1e-7,
                     collective_s=1e-3)


# ---- inference -------------------------------------------------------------------------

def test_inference_one_gpu():
    c = cost_model().mfc_cost(mfc("inference"), TOY, "lm", mesh(1), Layout(), 1)
    rows = 8 * 48                                  # 8 sequences of 16 + 32 tokens
    check(c.terms_s, {
        "gemm": rows * 2 * 155648 / R,
        "attention": rows * 1024 * 24 / R,         # causal: 24 keys on average
        "tp_comm": 0.0, "dp_comm": 0.0,
        "fixed": 1e-3 + 1e-4 + 4 * 1e-5 + 4 * rows * H * HID_S + rows * 128 * VOCAB_S})
    assert c.time_s == approx(sum(c.terms_s.values()))


def test_a_second_micro_batch_adds_its_fixed_costs_only():
    cm = cost_model()
    one = cm.mfc_cost(mfc("inference"), TOY, "lm", mesh(1), Layout(), 1).terms_s
    two = cm.mfc_cost(mfc("inference"), TOY, "lm", mesh(1), Layout(), 2).terms_s
    assert two["gemm"] == approx(one["gemm"]) and two["attention"] == approx(one["attention"])
    assert two["fixed"] - one["fixed"] == approx(1e-4 + 4 * 1e-5)


def test_inference_tp2_pp2_across_nodes():
    # 2 nodes of 2 GPUs: TP groups {0,1} {2,3} inside a node, PP groups {0,2} {1,3} across
    cm = cost_model(n_nodes=2, gpn=2, engines={"inference": ENGINE})
    c = cm.mfc_cost(mfc("inference"), TOY, "lm", mesh(4), Layout(tp=2, pp=2), 2)
    rows = 4 * 48                                  # 4 sequences per micro-batch
    act = rows * H * DT                            # 24576 bytes
    att = 2 * 2 * 2 * (2 * rows * 16 * 24) / R     # 2 layers x 2 heads x 2 GEMMs
    gemm_first = 2 * rows * 2 * 18432 / R
    gemm_last = gemm_first + 2 * rows * 64 * 64 / R
    tp_first = 4 * ar(act) + ar(act)               # 2 per layer + the embedding's
    tp_last = 4 * ar(act) + 3 * ar(rows * 4)       # + the vocab-parallel log-probs'
    send = p2p(act, inter=True)
    # fixed: micro-batch, 2 layers, 192 tokens, collectives (first: 5 + its send; last: 7)
    fixed_first = 0.1 + 2 * 0.01 + rows * 1e-6 + 6 * 1e-3
    fixed_last = 0.1 + 2 * 0.01 + rows * 1e-6 + 7 * 1e-3
    first = gemm_first + att + tp_first + send + fixed_first
    last = gemm_last + att + tp_last + fixed_last
    assert last > first                            # its extra collective's 1 ms paces it
    # the first micro-batch crosses both stages, the second adds the last stage's pass;
    # then the last stage broadcasts the 8 x 47 fp32 log-probs over PP (across nodes)
    check(c.terms_s, {
        "gemm": gemm_first + 2 * gemm_last, "attention": 3 * att,
        "tp_comm": tp_first + 2 * tp_last, "pp_comm": send,
        "dp_comm": 8 * 47 * 4 / B_INTER + LAT_INTER,
        "fixed": fixed_first + 2 * fixed_last + 1.0 + 1e-3})


def test_inference_dp2_gathers_the_values():
    cm = cost_model(engines={"inference": ENGINE})
    c = cm.mfc_cost(mfc("inference"), TOY, "value", mesh(2), Layout(dp=2), 1)
    rows = 4 * 48
    head = (64 + rows * 65) * DT / B_MEM           # [192, 64] x [64, 1]: memory-bound
    check(c.terms_s, {
        "gemm": 2 * rows * 4 * SPLIT / R + head, "attention": rows * 1024 * 24 / R,
        "tp_comm": 0.0,
        "dp_comm": ag2(8 * 48 * 4),                # one fp32 value per position
        "fixed": 1.0 + 0.1 + 4 * 0.01 + rows * 1e-6 + 1e-3})


# ---- train -----------------------------------------------------------------------------

def test_kernels_slower_in_a_pass_than_alone_cost_a_fraction_more():
    # kernel_extra 0.25: a quarter of the GEMM and attention seconds more, in "fixed"
    for kind in ("inference", "train"):
        base = cost_model(engines={kind: EngineCosts()}).mfc_cost(
            mfc(kind), TOY, "lm", mesh(1), Layout(), 2).terms_s
        got = cost_model(engines={kind: EngineCosts(kernel_extra=0.25)}).mfc_cost(
            mfc(kind), TOY, "lm", mesh(1), Layout(), 2).terms_s
        assert got["fixed"] - base["fixed"] == approx(0.25 * (base["gemm"] + base["attention"]))


def test_a_call_on_several_ranks_waits_for_the_slowest():
    # lag 0.5: on 2 ranks half the call's GEMM and attention seconds more (in "fixed");
    # on one rank nothing
    lag = EngineCosts(lag=0.5)
    for kind, layout, n in (("inference", Layout(dp=2), 2), ("train", Layout(tp=2), 2),
                            ("inference", Layout(), 1)):
        base = cost_model(engines={kind: EngineCosts()}).mfc_cost(
            mfc(kind), TOY, "lm", mesh(n), layout, 1).terms_s
        got = cost_model(engines={kind: lag}).mfc_cost(
            mfc(kind), TOY, "lm", mesh(n), layout, 1).terms_s
        work = base["gemm"] + base["attention"]
        assert got["fixed"] - base["fixed"] == approx(0.5 * work if n > 1 else 0.0), kind
    # generation: the prefill's and the decode's own lag, each on its own work
    gen = {"prefill": EngineCosts(lag=0.5), "decode": EngineCosts(lag=0.25)}
    base = cost_model(engines={"prefill": EngineCosts(), "decode": EngineCosts()}).mfc_cost(
        mfc("generate"), TOY, "lm", mesh(4), Layout(dp=4), 1).terms_s
    got = cost_model(engines=gen).mfc_cost(mfc("generate"), TOY, "lm", mesh(4), Layout(dp=4),
                                           1).terms_s
    scale = 1.0293754 / 0.5641896                  # 4 ranks against 2
    for part, c in (("prefill", 0.5), ("decode", 0.25)):
        work = base[f"{part}_gemm"] + base[f"{part}_attention"]
        assert got[f"{part}_fixed"] - base[f"{part}_fixed"] == pytest.approx(c * scale * work,
                                                                             rel=1e-5)


def test_train_one_gpu_steps_and_optimizer():
    m = mfc("train", minibatches=2, epochs=2)      # 4 optimizer steps of 4 sequences
    c = cost_model().mfc_cost(m, TOY, "lm", mesh(1), Layout(), 1)
    rows = 4 * 48
    step = {"gemm": rows * 6 * 155648 / R,
            "attention": 3 * rows * 1024 * 24 / R,
            "tp_comm": 0.0, "dp_grad_sync": 0.0,
            "fixed": (1e-3 + 1e-4 + 4 * 3e-5 + 4 * rows * H * HID_S_TRAIN
                      + rows * 128 * VOCAB_S_TRAIN + P_TP1 * PARAM_S)}
    check(c.terms_s, {k: 4 * v for k, v in step.items()})


def test_train_tp2_dp2_distributed_optimizer_in_one_node():
    cm = cost_model(engines={"train": ENGINE})
    m = mfc("train", n_seqs=16, minibatches=2)     # 2 steps x 2 replicas x 2 micro-batches
    c = cm.mfc_cost(m, TOY, "lm", mesh(4), Layout(tp=2, dp=2), 2)
    rows = 2 * 48
    p = 4 * (18432 + 128) + 4096 + 64 + 4096       # 82496 parameters on one GPU
    act = rows * H * DT
    micro = {"gemm": rows * 6 * (4 * 18432 + 4096) / R,
             "attention": 3 * rows * 1024 * 24 / 2 / R,
             "tp_comm": 17 * ar(act) + 3 * ar(rows * 4)}
    # fp32 gradients reduce-scattered, bf16 weights all-gathered over DP; the grad norm:
    # 2 all-reduces of 8 bytes over the 4 ranks (TP x DP)
    sync = ag2(4 * p) + ag2(DT * p) + 2 * ar(8, 4)
    fixed = 1.0 + 2 * (0.1 + 4 * 0.01 + rows * 1e-6 + 20 * 1e-3) + 4 * 1e-3 + p / 2 * 1e-7
    check(c.terms_s, {**{k: 2 * 2 * v for k, v in micro.items()},
                      "dp_grad_sync": 2 * sync, "fixed": 2 * fixed})


def test_train_tp2_dp2_plain_optimizer_across_nodes():
    cfg = EXACT.model_copy(update={"distributed_optimizer": False})
    cm = cost_model(n_nodes=2, gpn=2, config=cfg, engines={"train": ENGINE})
    m = mfc("train", n_seqs=16, minibatches=2)
    c = cm.mfc_cost(m, TOY, "lm", mesh(4), Layout(tp=2, dp=2), 2)
    p = 82496
    # DP groups {0,2} {1,3} cross the nodes: one rank per node, 2 x 1/2 x 4p / 1e9 + 2 x 10 us;
    # the grad norm over the TP pair stays in the node
    sync = 4 * p / B_INTER + 2 * LAT_INTER + 2 * ar(8)
    assert c.terms_s["dp_grad_sync"] == approx(2 * sync)
    rows = 2 * 48
    fixed = 1.0 + 2 * (0.1 + 4 * 0.01 + rows * 1e-6 + 20 * 1e-3) + 3 * 1e-3 + p * 1e-7
    assert c.terms_s["fixed"] == approx(2 * fixed)


def test_grad_norm_over_dp_across_nodes_pays_the_nic():
    cm = cost_model(n_nodes=2, gpn=2)
    m = mfc("train", n_seqs=16, minibatches=2)
    c = cm.mfc_cost(m, TOY, "lm", mesh(4), Layout(tp=2, dp=2), 2)
    p = 82496
    rs_x = 0.5 * 4 * p / B_INTER + LAT_INTER      # one rank per node
    ag_x = 0.5 * DT * p / B_INTER + LAT_INTER
    # 8 bytes over 4 ranks on 2 nodes (2 per node): max(2 x 1/2 x 8 / 1e10,
    # 2 x 1/2 x 4 / 1e9) + 2 x 1 us + 2 x 10 us
    norm = 2 * (4 / B_INTER + 2 * LAT_INTRA + 2 * LAT_INTER)
    assert c.terms_s["dp_grad_sync"] == approx(2 * (rs_x + ag_x + norm))


def test_train_pp2_four_micro_batches():
    c = cost_model().mfc_cost(mfc("train"), TOY, "lm", mesh(2), Layout(pp=2), 4)
    rows = 2 * 48
    att = 3 * rows * 1024 / 2 * 24 / R             # half the layers
    sends = 2 * p2p(rows * H * DT)                 # activations forward, gradients back
    first = (rows * 6 * 2 * SPLIT / R + att + sends
             + 1e-4 + 2 * 3e-5 + 2 * rows * H * HID_S_TRAIN)
    last = (rows * 6 * (2 * SPLIT + 8192) / R + att
            + 1e-4 + 2 * 3e-5 + 2 * rows * H * HID_S_TRAIN + rows * 128 * VOCAB_S_TRAIN)
    assert last > first                            # the head outweighs the sends
    p = 2 * (SPLIT + 128) + 64 + 8192              # the last stage is the heavier
    per_step = 1e-3 + p * PARAM_S + 2 * ar(8)      # call, optimizer, grad norm over PP
    assert c.time_s == approx(first + last + 3 * last + per_step)
    assert c.terms_s["pp_comm"] == approx(sends)
    assert c.terms_s["dp_grad_sync"] == approx(2 * ar(8))


# ---- generate --------------------------------------------------------------------------

def _gen_one_gpu(steps: int, ctx: float) -> dict[str, float]:
    """8 prompts of 16 tokens, one wave, on one GPU; ``steps`` decode steps at an
    average context of ``ctx`` keys."""
    return {
        # prefill: 128 prompt tokens through the layers, the head on the 8 newest
        "prefill_gemm": (128 * 2 * 4 * SPLIT + 8 * 2 * 8192) / R,
        "prefill_attention": 128 * 1024 * 8 / R,
        "prefill_tp_comm": 0.0,
        # zeroing the wave's cache: 8 x 4 layers x (K, V) x 2 heads x 16 x 2 B x 48
        "prefill_kv_alloc": 8 * 4 * 2 * 2 * 16 * 2 * 48 / B_MEM,
        "prefill_fixed": 1e-4 + 4 * 1e-5 + 4 * 128 * H * HID_S + 8 * 128 * VOCAB_S,
        "decode_gemm": steps * 8 * 2 * 155648 / R,
        "decode_attention": steps * 8 * 1024 * ctx / R,
        "decode_tp_comm": 0.0,
        "decode_fixed": steps * (1e-4 + 4 * 2e-5 + 4 * 8 * H * HID_S + 8 * 128 * VOCAB_S),
        "dp_comm": 0.0, "fixed": 1e-3}


def test_generate_one_gpu():
    c = cost_model().mfc_cost(mfc("generate"), TOY, "lm", mesh(1), Layout(), 1)
    # 32 tokens: the prefill yields the first, 31 decode steps at 16 + 32/2 keys
    check(c.terms_s, _gen_one_gpu(31, 32))


def test_generate_stops_at_the_first_check_after_the_longest_response():
    # every response 3 tokens: the wave decodes 8 (one stop check), 7 steps at 16 + 4 keys
    c = cost_model().mfc_cost(mfc("generate", lengths=GenLengths(max_len=32, histogram=(
        (3, 1.0),))), TOY, "lm", mesh(1), Layout(), 1)
    check(c.terms_s, _gen_one_gpu(7, 20))


def test_data_parallel_generation_waits_for_the_slowest_rank():
    """Lengths 3 or 20 (cap 32), equally likely. One wave of 4 rows on each of 2 DP
    ranks: the call lasts as long as the longest of all 8 rows, not of one rank's 4:
    P(all 8 stop at the first check, 8 tokens) = 1/256, else 24 (20 rounded up).
    Counted by the decode engine's per-step micro-batch cost (1 s a wave step)."""
    lengths = GenLengths(max_len=32, histogram=((3, 1.0), (20, 1.0)))
    engines = {"prefill": EngineCosts(), "decode": EngineCosts(microbatch_s=1.0)}
    c = cost_model(engines=engines).mfc_cost(mfc("generate", lengths=lengths), TOY, "lm",
                                              mesh(2), Layout(dp=2), 1)
    tokens = 8 / 256 + 24 * 255 / 256
    assert c.terms_s["decode_fixed"] == approx(tokens - 1)   # 4 rows alone: 23 (8/16 + 24 15/16)


def test_generate_pp2_four_waves_in_two_groups():
    c = cost_model().mfc_cost(mfc("generate"), TOY, "lm", mesh(2), Layout(pp=2), 4)
    # 2 sequences a wave; 2 waves in flight (one per stage), 2 groups one after another
    pre_att = 2 * 4 * 2 * (2 * 32 * 16 * 8) / R
    pre_fixed = 1e-4 + 2 * 1e-5 + 2 * 32 * H * HID_S
    pre_first = 32 * 2 * 2 * SPLIT / R + pre_att + p2p(32 * H * DT) + pre_fixed
    pre_last = (32 * 2 * 2 * SPLIT + 2 * 2 * 8192) / R + pre_att + pre_fixed + 2 * 128 * VOCAB_S
    assert pre_first > pre_last
    alloc = 2 * 2 * 2 * 2 * 2 * 16 * 2 * 48 / B_MEM     # 2 waves x 2 seqs x 2 layers ...
    dec_att = 2 * 4 * 2 * (2 * 2 * 16 * 32) / R
    dec_fixed = 1e-4 + 2 * 2e-5 + 2 * 2 * H * HID_S
    dec_first = 2 * 2 * 2 * SPLIT / R + dec_att + p2p(2 * H * DT) + dec_fixed
    # the last stage sends the 2 chosen tokens (and log-probs, 2 x 2 x 8 B) back
    dec_last = ((2 * 2 * 2 * SPLIT + 2 * 2 * 8192) / R + dec_att + p2p(32) + dec_fixed
                + 2 * 128 * VOCAB_S)
    assert dec_last > dec_first
    prefill = 2 * (pre_first + pre_last + pre_first + alloc)      # (g + pp - 1) slots
    decode = 2 * 31 * 2 * dec_last                                # pp slots per step
    assert c.time_s == approx(prefill + decode + 1e-3)
    assert c.terms_s["prefill_pp_comm"] == approx(2 * 2 * p2p(32 * H * DT))
    assert c.terms_s["decode_pp_comm"] == approx(2 * 31 * 2 * p2p(32))


def test_generate_tp2_dp2_collectives():
    engines = {"prefill": EngineCosts(call_s=1.0, collective_s=1e-3),
               "decode": EngineCosts(microbatch_s=0.1, layer_s=0.01, collective_s=1e-3)}
    c = cost_model(engines=engines).mfc_cost(mfc("generate"), TOY, "lm", mesh(4),
                                             Layout(tp=2, dp=2), 1)
    # 4 sequences per replica. Prefill: 2 all-reduces per layer and the embedding's on
    # 64 x 64 bf16 activations, then the 4 newest rows' logits all-gathered (4 x 128 bf16)
    assert c.terms_s["prefill_tp_comm"] == approx(9 * ar(64 * H * DT) + ag2(4 * 128 * DT))
    assert c.terms_s["prefill_fixed"] == approx(10 * 1e-3)
    assert c.terms_s["decode_tp_comm"] == approx(31 * (9 * ar(4 * H * DT) + ag2(4 * 128 * DT)))
    assert c.terms_s["decode_fixed"] == approx(31 * (0.1 + 4 * 0.01 + 10 * 1e-3))
    # the outputs gathered over DP: 8 sequences x (2 x 32 + 1) int64/fp64 values
    assert c.terms_s["dp_comm"] == approx(ag2(8 * 65 * 8))
    assert c.terms_s["fixed"] == approx(1.0 + 1e-3)
