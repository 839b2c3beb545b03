"""The analytic cost model: time and memory of one MFC under one allocation.

Notation: P_mm = weights a token multiplies through (all layer GEMMs + the head),
L layers, h hidden, s sequence length, b sequences per micro-batch, m micro-batches,
n_h heads, d head size. Rates: R = peak FLOP/s x matmul efficiency, B_mem = memory
bandwidth x efficiency, B_link = link bandwidth x efficiency (intra- or inter-node).

Time terms (seconds), per pipeline stage and micro-batch unless stated:
* GEMM rate by size (FLOP/s): a pass whose layer GEMMs have ``M`` rows (tokens of one
  micro-batch: ``b s`` in training and inference, ``b x prompt`` in prefill, ``b`` in
  a decode step) and a mean TP-sharded width ``w = (layer TP-split params) / (4 h tp)``
  (the mean of the QKV, proj, fc1, fc2 sharded dimensions, columns per GPU) runs at
  ``R_M = R x M/(M + M_half) x w/(w + w_half)`` (``gemm_half_rows``,
  ``gemm_half_width``; 128 each by default, 0 switches a factor off). Why: a GEMM
  with few rows is memory-bound (arithmetic intensity ~M FLOP/byte against a ridge
  of ~295 on an H100: 989 TFLOP/s over 3.35 TB/s) and leaves SMs idle (tile and wave
  quantization, NVIDIA's "Matrix Multiplication Background" guide); DeepGEMM's
  published Hopper table gives 206 / 352 TFLOP/s at M = 64 / 128 (N=2112, K=7168)
  against ~1500 at M = 4096, i.e. ~0.14 / 0.23 of the large-M rate, where the curve
  gives 0.33 / 0.5 (the bf16 ridge is half the FP8 one, so bf16 saturates earlier).
  Large GEMMs (M in the thousands, w >= 1000) keep 0.9-0.97 of R.
* compute: FLOPs / (tp * pp * R_M), with forward FLOPs per token
  ``2 P_mm + 4 L n_h d c`` (c = attended context: s/2 causal, prompt + gen/2 in decode);
  backward = 2x forward; recomputation adds one forward.
* TP: 2 all-reduces of ``b s h`` activations per layer forward (2 more backward, 2
  more with recomputation); ring all-reduce = ``2 (n-1)/n * bytes / B_link`` plus a
  latency of ``2 log2(n)`` messages.
* PP: ``(m + pp - 1)`` stage slots per pipelined pass (the bubble), plus activation
  sends between stages.
* generation runs its ``m`` micro-batches as *waves*, as the runtime does: ``g =
  min(m, pp)`` waves are in flight together, pipelined over the stages, and
  ``ceil(m / g)`` such groups run one after another. A group costs ``(g + pp - 1)``
  prefill slots and ``pp`` decode slots per generated token (``g = pp`` keeps every
  stage busy; fewer waves leave bubbles); with pp = 1 the waves simply run in turn.
* decode step: ``max(compute at R_b, (stage weights + KV cache read) / B_mem)`` -
  memory-bound.
* DP, per optimizer step: gradients are reduced in fp32 (``grad_dtype_bytes``, as
  Megatron's ``grad_reduce_in_fp32``): a ring all-reduce of ``4 P`` bytes, or with
  the distributed optimizer a reduce-scatter of ``4 P`` bytes plus an all-gather of
  the updated ``param_dtype x P`` weights (each ``(n-1)/n * bytes / B_link`` plus
  ``log2(n)`` message latencies); P = the stage's parameters on one GPU.
* optimizer: ``optimizer_step_bytes_per_param`` bytes of traffic per local parameter.
* fixed costs: ``layer_overhead_s`` per layer per pass per micro-batch (kernel launches,
  framework work: dominant for small micro-batches and in decoding) and
  ``microbatch_overhead_s`` per micro-batch slot of a pipelined pass (device spec).

Memory terms (bytes per GPU): weights ``param_dtype x params/tp`` of the heaviest
stage; training adds fp32 main grads and optimizer state (divided by dp with the
distributed optimizer) and 1F1B activations for ``min(pp, m)`` micro-batches in
flight; inference adds one micro-batch's layer activations and fp32 logits;
generation adds the KV cache of the waves in flight (``g`` waves of ``b`` sequences;
each wave's cache is allocated when it starts and freed when it ends, for
``prompt_len + gen_len`` tokens rounded up to whole ``kv_cache_block_tokens`` blocks)
and the logits of one step.

A :class:`~planner.profile.ProfileTable` measured on real hardware overrides the
device rates (a measured GEMM rate stands for R, large GEMMs; the size curve still
scales it) and, where it has an entry, whole MFC times. The cost model never
starts profiling by itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from planner.cluster import ClusterSpec
from planner.cost_config import CostModelConfig
from planner.graph import MFC
from planner.layout import Layout, dp_groups, group_spans_nodes
from planner.mesh import DeviceMesh
from planner.model_spec import ModelSpec
from planner.profile import ProfileTable


@dataclass(frozen=True)
class MFCCost:
    """Time and memory of one MFC under one allocation."""

    time_s: float
    terms_s: dict[str, float]          #: time by term (compute, tp_comm, bubble, ...)
    weights_bytes: float               #: this layout's weights on the heaviest GPU
    resident_bytes: float              #: state that stays between calls (train: weights+grads+optimizer)
    activation_bytes: float            #: transient working memory during the call


class CostModel:
    """Analytic time and memory of MFCs on a cluster, optionally overridden by a profile."""

    def __init__(self, cluster: ClusterSpec, config: CostModelConfig | None = None,
                 profile: ProfileTable | None = None):
        self.cluster = cluster
        self.config = config or CostModelConfig()
        self.profile = profile
        dev, cfg = cluster.device, self.config
        rates = profile.rates if profile is not None else None
        self.flops_per_s = (rates.matmul_flops_per_s if rates and rates.matmul_flops_per_s
                            else dev.peak_flops * cfg.matmul_efficiency)
        self.mem_bytes_per_s = (rates.mem_bytes_per_s if rates and rates.mem_bytes_per_s
                                else dev.mem_bw_bytes_per_s * cfg.mem_bw_efficiency)
        self.intra_bytes_per_s = (rates.intra_node_bytes_per_s if rates and rates.intra_node_bytes_per_s
                                  else dev.intra_node_bytes_per_s * cfg.link_efficiency)
        self.inter_bytes_per_s = (rates.inter_node_bytes_per_s if rates and rates.inter_node_bytes_per_s
                                  else dev.inter_node_bytes_per_s * cfg.link_efficiency)
        self.layer_overhead_s = (rates.layer_overhead_s if rates and rates.layer_overhead_s is not None
                                 else dev.layer_overhead_s)
        self.microbatch_overhead_s = (
            rates.microbatch_overhead_s if rates and rates.microbatch_overhead_s is not None
            else dev.microbatch_overhead_s)

    @property
    def mem_limit_bytes(self) -> float:
        return self.cluster.device.mem_bytes * self.config.mem_usable_fraction

    # ---- collectives -------------------------------------------------------------
    def allreduce_s(self, nbytes: float, n: int, inter_node: bool) -> float:
        """Ring all-reduce of ``nbytes`` over ``n`` ranks: a reduce-scatter then an
        all-gather."""
        return 2.0 * self.reduce_scatter_s(nbytes, n, inter_node)

    def reduce_scatter_s(self, nbytes: float, n: int, inter_node: bool) -> float:
        """Ring reduce-scatter (or all-gather) of ``nbytes`` over ``n`` ranks."""
        if n <= 1:
            return 0.0
        dev = self.cluster.device
        bw = self.inter_bytes_per_s if inter_node else self.intra_bytes_per_s
        lat = dev.inter_node_latency_s if inter_node else dev.intra_node_latency_s
        return (n - 1) / n * nbytes / bw + math.ceil(math.log2(n)) * lat

    def p2p_s(self, nbytes: float, inter_node: bool) -> float:
        dev = self.cluster.device
        if inter_node:
            return nbytes / self.inter_bytes_per_s + dev.inter_node_latency_s
        return nbytes / self.intra_bytes_per_s + dev.intra_node_latency_s

    # ---- sizes -------------------------------------------------------------------
    @staticmethod
    def stage_params(spec: ModelSpec, head: str, layout: Layout) -> float:
        """Parameters on one GPU of the heaviest pipeline stage."""
        tp, pp = layout.tp, layout.pp
        per_layer = spec.layer_sharded_params() / tp + spec.layer_replicated_params()
        body = spec.n_layers // pp * per_layer
        first = body + spec.embedding_params() / tp
        if head == "value":
            head_p = spec.hidden
        elif spec.tied_embeddings and pp == 1:
            head_p = 0.0
        else:
            head_p = spec.embedding_params() / tp
        last = body + spec.hidden + head_p
        return first + spec.hidden + head_p if pp == 1 else max(first, last)

    def _act_bytes_per_token_layer(self, spec: ModelSpec, tp: int) -> float:
        """Stored activations of one token in one layer (bf16, flash attention)."""
        dt = self.config.param_dtype_bytes
        sharded = spec.qkv_out + spec.n_heads * spec.kv_channels + 3 * spec.ffn_hidden
        return dt * (5 * spec.hidden + sharded / tp)

    def kv_cache_bytes(self, spec: ModelSpec, mfc: MFC, layout: Layout, waves: int) -> float:
        """Peak KV-cache bytes per GPU of a generation run as ``waves`` waves: the
        ``min(waves, pp)`` waves in flight, each ``n_seqs / (dp waves)`` sequences of
        ``prompt_len + gen_len`` positions rounded up to whole cache blocks, keys and
        values of the stage's ``L / pp`` layers for its ``n_kv_heads / tp`` heads.

        Example: 2 layers, 2 KV heads of 16, fp32, 64 sequences at dp 1 in 2 waves,
        8 + 4 tokens (one 16-token block): 32 sequences x 2 layers x (2 x 2 x 16 x 4) bytes
        x 16 positions = 262144 bytes.
        """
        tp, pp = layout.tp, layout.pp
        block = self.config.kv_cache_block_tokens
        positions = -(-(mfc.prompt_len + mfc.gen_len) // block) * block
        per_token_layer = 2 * (spec.n_kv_heads / tp) * spec.kv_channels * self.config.param_dtype_bytes
        in_flight = min(waves, pp) * mfc.n_seqs / layout.dp / waves
        return in_flight * spec.n_layers / pp * per_token_layer * positions

    def gemm_rate(self, spec: ModelSpec, rows: float, tp: int) -> float:
        """Achieved FLOP/s of one layer's GEMMs with ``rows`` tokens on one GPU:
        ``R x rows/(rows + r_half) x w/(w + w_half)``, w the mean TP-sharded width."""
        cfg = self.config
        rate = self.flops_per_s
        if cfg.gemm_half_rows > 0:
            rate *= rows / (rows + cfg.gemm_half_rows)
        if cfg.gemm_half_width > 0:
            w = spec.layer_sharded_params() / (4.0 * spec.hidden * tp)
            rate *= w / (w + cfg.gemm_half_width)
        return rate

    def _fwd_flops_per_token(self, spec: ModelSpec, head: str, context: float) -> float:
        attn = 4.0 * spec.n_layers * spec.n_heads * spec.kv_channels * context
        return 2.0 * spec.matmul_params_per_token(head) + attn

    def _spans(self, mesh: DeviceMesh, layout: Layout) -> tuple[bool, bool]:
        """(DP group crosses nodes, a pipeline boundary crosses nodes)."""
        gpn = self.cluster.gpus_per_node
        dp_inter = group_spans_nodes(dp_groups(layout)[0], mesh, gpn) if layout.dp > 1 else False
        # A mesh spanning nodes has at least one stage boundary across nodes, and the
        # slowest boundary paces the pipeline.
        pp_inter = layout.pp > 1 and mesh.n_gpus > gpn
        return dp_inter, pp_inter

    # ---- the MFC cost ------------------------------------------------------------
    def mfc_cost(self, mfc: MFC, spec: ModelSpec, head: str, mesh: DeviceMesh,
                 layout: Layout, micro_batches: int) -> MFCCost:
        cfg = self.config
        tp, pp, dp, m = layout.tp, layout.pp, layout.dp, micro_batches
        dt = cfg.param_dtype_bytes
        h, L = spec.hidden, spec.n_layers
        p_gpu = self.stage_params(spec, head, layout)
        weights = dt * p_gpu
        dp_inter, pp_inter = self._spans(mesh, layout)
        logit_cols = spec.padded_vocab / tp if head == "lm" else 1.0
        terms: dict[str, float] = {}

        if mfc.kind == "generate":
            seqs = mfc.n_seqs / dp
            b = seqs / m                       # sequences per wave
            g = min(m, pp)                     # waves in flight together
            groups = math.ceil(m / g)          # groups of waves, one after another
            # prefill: compute-bound forward over the prompts
            pre_tok = b * mfc.prompt_len
            pre_flops = pre_tok * self._fwd_flops_per_token(spec, head, mfc.prompt_len / 2)
            pre_stage = (pre_flops / (tp * pp * self.gemm_rate(spec, pre_tok, tp))
                         + L / pp * 2 * self.allreduce_s(pre_tok * h * dt, tp, False)
                         + (self.p2p_s(pre_tok * h * dt, pp_inter) if pp > 1 else 0.0)
                         + L / pp * self.layer_overhead_s + self.microbatch_overhead_s)
            terms["prefill"] = groups * (g + pp - 1) * pre_stage
            # decode: memory-bound; each micro-batch step reads the stage weights + KV
            ctx = mfc.prompt_len + mfc.gen_len / 2
            kv_tok_layer = 2 * (spec.n_kv_heads / tp) * spec.kv_channels * dt
            kv_read = b * L / pp * kv_tok_layer * ctx
            flops = b * self._fwd_flops_per_token(spec, head, ctx) / (tp * pp)
            step = max(flops / self.gemm_rate(spec, b, tp), (weights + kv_read) / self.mem_bytes_per_s)
            step += L / pp * 2 * self.allreduce_s(b * h * dt, tp, False)
            step += L / pp * self.layer_overhead_s
            if pp > 1:
                step += self.p2p_s(b * h * dt, pp_inter)
            terms["decode"] = groups * mfc.gen_len * pp * step
            act = (self.kv_cache_bytes(spec, mfc, layout, m) + 4.0 * b * logit_cols * 2
                   + b * mfc.prompt_len * self._act_bytes_per_token_layer(spec, tp))
            resident = weights
        else:
            train = mfc.kind == "train"
            steps = mfc.n_minibatches * mfc.n_epochs if train else 1
            seqs = mfc.n_seqs / (mfc.n_minibatches if train else 1) / dp
            b = seqs / m
            tok = b * mfc.seq_len
            fwd = tok * self._fwd_flops_per_token(spec, head, mfc.seq_len / 2)
            passes = (3.0 + (1.0 if cfg.activation_recompute else 0.0)) if train else 1.0
            n_ar = (4 + (2 if cfg.activation_recompute else 0)) if train else 2
            compute = passes * fwd / (tp * pp * self.gemm_rate(spec, tok, tp))
            fixed = passes * L / pp * self.layer_overhead_s + self.microbatch_overhead_s
            tp_comm = L / pp * n_ar * self.allreduce_s(tok * h * dt, tp, False)
            p2p = (2 if train else 1) * self.p2p_s(tok * h * dt, pp_inter) if pp > 1 else 0.0
            terms["compute"] = steps * m * compute
            terms["tp_comm"] = steps * m * tp_comm
            terms["pp_comm"] = steps * m * p2p
            terms["overhead"] = steps * m * fixed
            terms["pp_bubble"] = steps * (pp - 1) * (compute + tp_comm + p2p + fixed)
            act_layer = tok * self._act_bytes_per_token_layer(spec, tp)
            if train:
                grad_bytes = cfg.grad_dtype_bytes * p_gpu
                if cfg.distributed_optimizer:   # reduce-scatter grads, all-gather new weights
                    sync = (self.reduce_scatter_s(grad_bytes, dp, dp_inter)
                            + self.reduce_scatter_s(weights, dp, dp_inter))
                else:
                    sync = self.allreduce_s(grad_bytes, dp, dp_inter)
                terms["dp_grad_sync"] = steps * sync
                opt_params = p_gpu / (dp if cfg.distributed_optimizer else 1)
                terms["optimizer"] = (steps * opt_params * cfg.optimizer_step_bytes_per_param
                                      / self.mem_bytes_per_s)
                in_flight = min(pp, m)
                per_layer = (tok * h * dt) if cfg.activation_recompute else act_layer
                act = in_flight * L / pp * per_layer + (act_layer if cfg.activation_recompute else 0)
                act += 2 * 4.0 * tok * logit_cols
                opt_state = cfg.optimizer_state_bytes_per_param / (
                    dp if cfg.distributed_optimizer else 1)
                resident = weights + p_gpu * (cfg.grad_dtype_bytes + opt_state)
            else:
                act = 2 * act_layer + 2 * 4.0 * tok * logit_cols
                resident = weights
        time_s = sum(terms.values())
        if self.profile is not None:
            measured = self.profile.lookup_mfc(spec.name, mfc, layout, micro_batches)
            if measured is not None:
                terms = {"measured": measured}
                time_s = measured
        return MFCCost(time_s=time_s, terms_s=terms, weights_bytes=weights,
                       resident_bytes=resident, activation_bytes=act)
