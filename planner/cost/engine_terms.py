"""One micro-batch through one pipeline stage of realign's engines, as priced work.

Both the cost model (:mod:`planner.cost.cost_model`, which composes stages, micro-batches,
waves and steps into an MFC's time) and ``realign profile`` (which fits the engines'
fixed costs to timed runs) read these functions, so a fitted constant means exactly
what the cost model charges it for.

A :class:`Work` is seconds already priced from rates (GEMMs, attention, collectives,
memory traffic) plus *counts* of the engine's fixed costs
(:class:`~planner.cost.profile.EngineCosts`): one ``microbatch_s`` per pass, one
``layer_s`` per layer, ``token_hidden_s`` per token x hidden unit x layer,
``token_s`` per token, ``token_vocab_s`` per output row x vocabulary column (the
head's log-softmax or sampling), ``call_s`` per call and ``param_s`` per parameter
(counted by the callers), ``collective_s`` per collective or message between ranks,
``score_s`` per attention score of a whole-sequence pass (train, inference: ``rows x
ctx`` per head and layer; the engines' attention masks and softmaxes the whole score
matrix, which grows with the square of the length; generation is not counted: its
prompts are short in the profile's probes, and a decode step scores one row), and
``lag`` per second of a call's GEMMs and attention when it spans several ranks (see
:func:`lagged`).
What a pass does, per kind (the runtime's code):

* ``inference`` (``StageDecoder.score``) and ``train`` (the same forward under
  megatron's schedule, then backward): per layer the QKV, projection, FC1 and FC2
  GEMMs, causal attention over ``ctx`` keys, and with TP two all-reduces of the
  activations (two more in backward); the first stage's embedding (an all-reduce with
  TP); the last stage's head over every position and, for an LM head, the
  vocabulary-parallel log-probs (three all-reduces of one value per token with TP);
* ``prefill`` and ``decode`` (``StageDecoder.prefill`` / ``step``): the same layers
  (decode: one new token per row, attention reading the cache), the head on each
  row's newest position only, gathered over TP (an all-gather), and sampling over the
  vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from statistics import NormalDist

from planner.cost.moe_terms import mlp_gemms, sparse_mlp_s
from planner.cost.profile import EngineCosts
from planner.cost.rates import Rates
from planner.specs.lora import COLUMN, LoraSpec
from planner.specs.model_spec import ModelSpec

FIXED = ("call_s", "microbatch_s", "layer_s", "token_hidden_s", "token_vocab_s", "token_s",
         "param_s", "collective_s", "score_s", "kernel_extra", "lag")
#: the fixed costs the host pays (Python, kernel launches, per-row bookkeeping) ...
HOST_FIXED = ("call_s", "microbatch_s", "layer_s", "token_s", "collective_s")
#: ... and those that price device memory traffic (elementwise passes over activations,
#: the head's log-softmax, the optimizer step): on a device that runs kernels
#: asynchronously (``DeviceSpec.async_kernels``) these run on the device, beside the
#: GEMMs, while the host goes on launching
DEVICE_FIXED = ("token_hidden_s", "token_vocab_s", "param_s", "score_s", "kernel_extra", "lag")


@dataclass
class Work:
    """Priced seconds by term, plus counts of fixed costs."""

    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)

    def add(self, other: "Work", times: float = 1.0) -> "Work":
        for k, v in other.seconds.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + times * v
        for k, v in other.counts.items():
            self.counts[k] = self.counts.get(k, 0.0) + times * v
        return self

    def fixed_s(self, costs: EngineCosts) -> float:
        return sum(n * float(getattr(costs, k)) for k, n in self.counts.items())

    def total(self, costs: EngineCosts) -> float:
        return sum(self.seconds.values()) + self.fixed_s(costs)

    def terms(self, costs: EngineCosts) -> dict[str, float]:
        out = dict(self.seconds)
        out["fixed"] = out.get("fixed", 0.0) + self.fixed_s(costs)
        return out


def overlapped(w: Work, costs: EngineCosts) -> Work:
    """One pass on a device that runs kernels asynchronously: the host's fixed costs
    (:data:`HOST_FIXED`: it launches the kernels and runs ahead) and the device's work
    (priced seconds and :data:`DEVICE_FIXED` traffic) overlap, so the pass costs the
    longer of the two, not their sum. The side that is hidden is dropped, so the terms
    still say what paces the pass.

    Example: host 3 layers x 0.5 ms = 1.5 ms, device GEMMs 0.4 ms: 1.5 ms, all "fixed";
    with GEMMs of 2.0 ms instead: 2.0 ms, all "gemm".
    """
    host = Work(counts={k: v for k, v in w.counts.items() if k in HOST_FIXED})
    device = Work(seconds=dict(w.seconds),
                  counts={k: v for k, v in w.counts.items() if k not in HOST_FIXED})
    return host if host.total(costs) >= device.total(costs) else device


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """The expected largest of ``n`` independent standard normal variates (0 for one),
    by the trapezoid rule over [-10, 10]: ``E = int x n phi(x) Phi(x)^(n-1) dx``.

    Example: 2 -> 1/sqrt(pi) = 0.5642; 4 -> 1.0294; 8 -> 1.4236."""
    if n <= 1:
        return 0.0
    normal, steps, lo, hi = NormalDist(), 4000, -10.0, 10.0
    dx = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * dx
        total += ((0.5 if i in (0, steps) else 1.0)
                  * x * n * normal.pdf(x) * normal.cdf(x) ** (n - 1))
    return total * dx


def rank_lag(n: int) -> float:
    """How far the slowest of ``n`` ranks lags, relative to 2 ranks (the profile's
    measurement): if each rank's time wanders by the same normal spread, the call ends
    with the largest of ``n`` draws. 0 for one rank.

    Example: 2 -> 1; 4 -> 1.82; 8 -> 2.52."""
    return expected_max_normal(n) / expected_max_normal(2) if n > 1 else 0.0


def lagged(w: Work, ranks: int) -> Work:
    """``w`` (a call's or an optimizer step's work on one rank) with its ``lag`` count:
    its priced GEMM and attention seconds, scaled by :func:`rank_lag` of the ``ranks``
    that must all finish (the call returns, or the next collective proceeds, when the
    slowest has). Nothing for one rank.

    Example: 0.04 s of GEMMs on 2 ranks, ``lag`` 0.1: 0.004 s more."""
    scale = rank_lag(ranks)
    if scale > 0:
        work = sum(v for k, v in w.seconds.items() if k in ("gemm", "attention"))
        w.counts["lag"] = w.counts.get("lag", 0.0) + scale * work
    return w


def layer_gemms(spec: ModelSpec, tp: int) -> list[tuple[float, float]]:
    """(K, N) of one layer's GEMMs on one TP rank: QKV, projection, FC1 (gate and up),
    FC2; a mixture of experts' MLP is priced apart (:mod:`planner.cost.moe_terms`)."""
    h = spec.hidden
    attention = [(h, spec.qkv_out / tp), (spec.n_heads * spec.kv_channels / tp, h)]
    return attention if spec.moe is not None else attention + mlp_gemms(spec, tp)


def stage_pass(r: Rates, spec: ModelSpec, head: str, kind: str, rows: float, ctx: float,
               out_rows: float, tp: int, layers: int, first: bool, last: bool,
               tp_nodes: int = 1, lora: LoraSpec | None = None, ep: int = 1,
               ep_nodes: int = 1) -> Work:
    """One micro-batch of ``rows`` tokens (decode: ``rows`` sequences, one token each)
    through ``layers`` layers of one stage, attending over ``ctx`` keys on average;
    ``out_rows`` rows reach the head on the last stage. ``kind``: train | inference |
    prefill | decode.

    ``lora``: the model carries LoRA adapters, which every pass runs beside the base
    (realign's forward is LoRA-aware; nothing is merged): each layer adds the adapters'
    two thin GEMMs per target and a rank-wide TP all-reduce per target. Training then
    computes no gradient of the frozen base weights: a base GEMM costs its forward and
    its input gradient (two forward GEMMs instead of three), the adapters a full
    forward + backward.

    ``ep`` (a mixture of experts, expert-parallel over an EP group spanning ``ep_nodes``
    nodes): each rank runs its ``n_experts / ep`` experts on the tokens routed to them,
    and each sparse layer exchanges the tokens by two all-to-alls per pass, four in
    training (:mod:`planner.cost.moe_terms`), priced as ``ep_comm``."""
    train = kind == "train"
    dt = r.dtype_bytes
    h, d = spec.hidden, spec.kv_channels
    heads = spec.n_heads / tp
    w = Work()
    if lora is not None and train:
        def price(m: float, k: float, n: float) -> float:
            return 2 * r.gemm_s(m, k, n)
    else:
        def price(m: float, k: float, n: float) -> float:
            return r.gemm_s(m, k, n, train)
    base = (sum(price(rows, k, n) for k, n in layer_gemms(spec, tp))
            + sparse_mlp_s(spec, rows, tp, price, ep))
    adapters = (sum(r.gemm_s(rows, k, n, train) for k, n in lora.gemms(spec, tp))
                if lora is not None else 0.0)
    gemm = layers * (base + adapters)
    # attention (QK^T, then AV) runs as one batched call over the heads (the engines'
    # scaled_dot_product_attention), so it is priced as one GEMM of heads x rows rows
    att = layers * (r.gemm_s(heads * rows, d, ctx, train) + r.gemm_s(heads * rows, ctx, d, train))
    if kind == "decode":            # the new token reads the whole cache
        kv = rows * ctx * 2 * (spec.n_kv_heads / tp) * d * dt
        att = max(att, layers * r.kv_read_s(kv))
    lm = head == "lm"
    vocab = spec.padded_vocab if lm else 1
    if last:
        if lm and lora is not None and train:      # the frozen LM head: no weight gradient
            gemm += 2 * r.gemm_s(out_rows, h, vocab / tp)
        else:
            gemm += r.gemm_s(out_rows, h, vocab / tp if lm else 1, train)
    w.seconds["gemm"] = gemm
    w.seconds["attention"] = att
    comm, n_coll = 0.0, 0
    if tp > 1:
        act = rows * h * dt
        n_coll += layers * (4 if train else 2)
        comm += layers * (4 if train else 2) * r.collective_s("all_reduce", act, tp, tp_nodes)
        if first:
            n_coll += 1
            comm += r.collective_s("all_reduce", act, tp, tp_nodes)
        if lora is not None:
            # per target: the row-parallel adapters sum x A^T forward, the column-parallel
            # ones the gradient of x A^T backward ([rows, A's rows] each)
            summed = [lora.a_rows(t) for t in lora.targets if train or t not in COLUMN]
            n_coll += layers * len(summed)
            comm += layers * sum(r.collective_s("all_reduce", rows * width * dt, tp, tp_nodes)
                                 for width in summed)
        if last and lm:
            if kind in ("train", "inference"):
                n_coll += 3
                comm += 3 * r.collective_s("all_reduce", rows * 4, tp, tp_nodes)
            else:
                n_coll += 1
                comm += r.collective_s("all_gather", out_rows * vocab * dt, tp, tp_nodes)
    w.seconds["tp_comm"] = comm
    a2a = 0.0
    if ep > 1 and spec.moe is not None:
        a2a = layers * spec.sparse_layers() / spec.n_layers * (4 if train else 2)
        w.seconds["ep_comm"] = a2a * r.all_to_all_s(
            rows * spec.moe.top_k * spec.hidden * dt, ep, ep_nodes)
    scores = layers * heads * rows * ctx if kind in ("train", "inference") else 0.0
    w.counts = {"microbatch_s": 1.0, "layer_s": float(layers), "score_s": float(scores),
                "token_hidden_s": float(layers * rows * h), "token_s": float(rows),
                "token_vocab_s": (float(out_rows * (vocab / tp if kind in ("train", "inference")
                                                    else vocab)) if last and lm else 0.0),
                "collective_s": float(n_coll) + a2a, "kernel_extra": gemm + att}
    return w


def stage_layers(n_layers: int, pp: int) -> int:
    return n_layers // pp
