"""A generate call on vLLM, priced: continuous batching, not waves.

vLLM runs one engine per data-parallel rank of the call's layout, at its TP (PP 1:
the replica's TP rank 0 hosts it, one vLLM worker per GPU of its TP group); each
engine generates its data-parallel share of ``n = n_seqs / dp`` sequences. Its
scheduler admits up to ``S`` sequences at once
(:func:`concurrency`: ``vllm_max_num_seqs``, and no more than its KV cache holds at
full length) and refills a slot as soon as a sequence ends, so no sequence waits for
the longest of a wave (:mod:`planner.graph.lengths`'s straggler tail is the waves'
price, not vLLM's). Per engine:

* one prefill pass over every prompt (``n x`` the padded prompt length);
* decode steps: each advances every running sequence by one token. With ``L`` the
  length distribution (mean ``E``): ``n <= S``: the longest of ``n`` lengths, minus the
  prefill's token, steps; otherwise the first ``n - S`` sequences pass through full
  slots (``(n - S) E / S`` steps) and the last ``S`` drain like a batch of ``S``. In
  all, ``n (E - 1)`` sequence-steps (:func:`decode_schedule`);
* a decode step of ``r`` rows costs ``c(1) + (c(S') - c(1)) (r - 1) / (S' - 1)`` with
  ``c`` the priced pass (:mod:`planner.cost.engine_terms`, GEMMs at ``r`` rows,
  attention over the cache, the head) with vLLM's fixed costs (``vllm_decode``: a
  profile's, measured by ``realign profile`` where vLLM is installed; else the
  device preset's) and ``S' = min(S, n)``: a step's weight reads are paid once, its
  rows add the rest;
* ``weight_load``: the weights copied into vLLM's own storage before the call
  (``realign``'s parameters after each training step, in memory, in buckets of whole
  layers: :mod:`realign.runtime.engines.vllm_weights`), :func:`weight_load_s`: the
  whole tensors gathered over the TP group (TP > 1), then :data:`LOAD_PASSES` passes
  over them at the memory bandwidth: packed into the bucket (host shared memory on a
  device that runs kernels synchronously, the cpu device; a GPU buffer shared by CUDA
  IPC on the GPU presets), copied out of it and loaded by each vLLM worker (all in
  parallel, each keeping its slice). A profile's measured ``vllm_load`` (fixed seconds and bytes per
  second of the shared-memory update, ``realign profile``) replaces the passes; when
  the call's layout differs from the training call's, the plan's reallocation into it
  comes first, priced as any other. A LoRA model (vLLM's own LoRA) loads its frozen
  base once, when the engine starts, and each call moves only its adapters:
  :func:`adapter_load_s`;
* ``decode_host_sync`` (``vllm_scheduler: sync``, vLLM v0): :data:`VLLM_SYNC_STEP_S`
  per decode step, the host's scheduling, input preparation and output processing
  between two steps, during which the device waits;
* ``decode_host_gap`` (``vllm_scheduler: async``, vLLM V1 with CUDA graphs, on a device
  that runs kernels asynchronously, without a profile's ``vllm_decode``):
  :data:`VLLM_ASYNC_STEP_GAP_S` per decode step. V1's scheduler runs a step ahead, so
  its scheduling and output processing overlap the device's step; what remains is the
  device's idle gap between one step's last kernel and the next step's graph replay
  (the next step's inputs copied in and the graph launched once the previous step's
  sampled tokens exist), which is not hidden;
* the outputs gathered over the data-parallel ranks, as realign's own engine does.

A mixture of experts: each engine holds every expert at the call's TP (vLLM's expert
parallelism is not used), so its passes are priced at EP 1 (the top-k experts' FLOPs
and the experts a step's rows reach: :mod:`planner.cost.moe_terms`) and, where the
replica runs at EP > 1, the weight load first gathers the other EP ranks' experts
(:func:`experts_gather_s`).

Memory per GPU: the model's weights (realign's copy), plus vLLM's copy of them, its KV
cache (``vllm_kv_cache_bytes``, allocated whole) and the logits of ``S`` rows; with
LoRA also vLLM's copy of the adapters (PEFT's layout, one adapter at a time).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from planner.cost.engine_terms import Work, lagged
from planner.cost.mfc_cost import MFCCost
from planner.graph.dataflow import MFC
from planner.graph.lengths import longest_moments
from planner.graph.padding import longest_prompt
from planner.specs.layout import Layout
from planner.specs.lora import LoraSpec
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec

if TYPE_CHECKING:
    from planner.cost.cost_model import CostModel

#: vLLM's fixed costs in a profile table's ``engines``
VLLM_PREFILL, VLLM_DECODE = "vllm_prefill", "vllm_decode"
#: passes over the whole weights of an in-memory update without a profile: packed into
#: the bucket, copied out of it by each vLLM worker (in parallel; vLLM keeps a layer's
#: tensors until it processes the layer), loaded into its parameters
LOAD_PASSES = 3
#: seconds the device waits between two decode steps of vLLM v0's synchronous engine
#: (scheduler, next step's input metadata, the sampled tokens' copy to the host and
#: their output processing): "about 4ms of GPU bubble" on every decode step in the
#: trace of vllm-project/vllm issue #6854 (docs/gpu-facts.md §3e)
VLLM_SYNC_STEP_S = 0.004
#: seconds the device idles between two decode steps of vLLM V1 with asynchronous
#: scheduling and CUDA graphs: the part of the per-step host work that does not overlap
#: the step. "the cudagraph token gap, which is currently 150-170us" at batch 256,
#: down from "5-6ms" without asynchronous scheduling, "gpu-util continued to be 100%"
#: (vllm-project/vllm PR #11133, V1; the midpoint; docs/gpu-terms.md)
VLLM_ASYNC_STEP_GAP_S = 160e-6
#: the ranks vLLM 0.32 accepts as ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: the largest LoRA rank vLLM takes
VLLM_MAX_LORA_RANK = max(VLLM_LORA_RANKS)


def generate_engine_options(mode: str, layout: Layout, micro_batches: int) -> tuple[str, ...]:
    """The engines a generate call is priced on under ``layout`` (``mode``: the
    ``generate_engine`` own | vllm | auto): realign's own; vLLM at PP 1 and one
    micro-batch, at any TP (one engine per data-parallel rank, continuous batching: no
    waves), without expert parallelism (each engine holds every expert); the search
    drops a layout whose KV cache holds no sequence (:func:`concurrency` below 1).

    Example: auto at tp 2, pp 1, 1 micro-batch -> ("own", "vllm"); vllm at pp 2 -> ()."""
    if mode == "own":
        return ("own",)
    fits = layout.pp == 1 and micro_batches == 1 and layout.ep == 1
    vllm = ("vllm",) if fits else ()
    return vllm if mode == "vllm" else ("own",) + vllm


def peft_adapter_params(spec: ModelSpec, lora: LoraSpec) -> int:
    """Parameters of the adapter vLLM receives: PEFT's layout, every adapted projection
    its own ``A`` and ``B`` (``shared_a``'s one ``A`` goes to every part).

    Example: 4 layers of hidden 256 (4 KV heads of 32), ffn 768, rank 8 on all seven
    projections: 4 x (8 x (6 x 256 + 768) + 8 x 2560) = 155,648."""
    return lora.model_copy(update={"shared_a": False}).total_params(spec)


def adapter_load_s(cm: "CostModel", adapter_bytes: float, tp: int = 1,
                   tp_nodes: int = 1) -> float:
    """Seconds to hand one engine a LoRA model's adapters, ``adapter_bytes`` in PEFT's
    layout (:mod:`realign.runtime.engines.vllm_lora`): the all-gather of the sharded
    factors over the TP group, then :data:`LOAD_PASSES` passes at the memory bandwidth
    (packed into a host shared-memory segment, copied out by each vLLM worker, loaded
    into vLLM's LoRA slots) and, on a device that runs kernels asynchronously (GPUs),
    the copies device to host and back over the host link (vLLM's LoRA manager loads an
    adapter on the host). The base is not sent: vLLM loads it once, at start.

    Example: 1e6 bytes at 1e10 B/s of memory, TP 1, cpu: 3 x 1e-4 = 3e-4 s."""
    gather = cm.rates.collective_s("all_gather", adapter_bytes, tp, tp_nodes) if tp > 1 else 0.0
    host = 2 * adapter_bytes / cm.rates.host_link_bytes_per_s \
        if cm.cluster.device.async_kernels else 0.0
    return gather + LOAD_PASSES * adapter_bytes / cm.rates.mem_bytes_per_s + host


def weight_load_s(cm: "CostModel", full_bytes: float, tp: int = 1, tp_nodes: int = 1) -> float:
    """Seconds to replace one engine's weights, ``full_bytes`` of whole tensors, from a
    replica at TP ``tp`` (its TP group on ``tp_nodes`` nodes): the all-gather of the
    whole tensors over the TP group, then a profile's measured ``vllm_load`` where
    there is one, else :data:`LOAD_PASSES` passes at the memory bandwidth.

    Example: 1e8 bytes at 1e10 B/s of memory, TP 1, no profile: 3 x 0.01 = 0.03 s."""
    gather = cm.rates.collective_s("all_gather", full_bytes, tp, tp_nodes) if tp > 1 else 0.0
    measured = cm.profile.vllm_load if cm.profile is not None else None
    if measured is not None:
        return gather + measured.fixed_s + full_bytes / measured.bytes_per_s
    return gather + LOAD_PASSES * full_bytes / cm.rates.mem_bytes_per_s


def experts_gather_s(cm: "CostModel", spec: ModelSpec, mesh: DeviceMesh,
                     layout: Layout) -> float:
    """Seconds for each rank of a replica at EP > 1 to gather the experts the other
    ranks of its EP group hold (its TP shard of every sparse layer's experts), which
    its engine needs whole: an all-gather over the EP group; 0 at EP 1.

    Example: 2 sparse layers of 1e6 expert parameters, bf16, TP 1, EP 2: an all-gather
    of 4e6 bytes over 2 ranks."""
    if layout.ep <= 1 or spec.moe is None:
        return 0.0
    nbytes = (cm.config.param_dtype_bytes * spec.sparse_layers() * spec.layer_expert_params()
              / layout.tp)
    return cm.rates.collective_s("all_gather", nbytes, layout.ep, cm.ep_nodes(mesh, layout))


def kv_bytes_per_seq(spec: ModelSpec, mfc: MFC, dtype_bytes: int, block_tokens: int,
                     tp: int = 1) -> float:
    """KV-cache bytes of one sequence at full length (``prompt_len + gen_len`` rounded
    up to whole blocks) on one GPU at TP ``tp``: keys and values of every layer, of the
    GPU's share of the KV heads (vLLM replicates a KV head over the ranks it cannot
    split among: at least one head each).

    Example: 4 layers, 4 KV heads of 32, fp32, 8 + 4 tokens (one 16-token block):
    4 x 2 x 4 x 32 x 4 x 16 = 65536 bytes at TP 1, 32768 at TP 2."""
    positions = -(-(mfc.prompt_len + mfc.gen_len) // block_tokens) * block_tokens
    heads = max(1, spec.n_kv_heads // tp)
    return spec.n_layers * 2 * heads * spec.kv_channels * dtype_bytes * positions


def concurrency(cm: "CostModel", spec: ModelSpec, mfc: MFC, tp: int = 1) -> int:
    """How many sequences one engine at TP ``tp`` decodes at once: ``vllm_max_num_seqs``,
    and no more than its KV cache (``vllm_kv_cache_bytes`` on each GPU) holds at full
    length (0: not even one)."""
    cfg = cm.config
    per = kv_bytes_per_seq(spec, mfc, cfg.param_dtype_bytes, cfg.kv_cache_block_tokens, tp)
    return min(cfg.vllm_max_num_seqs, int(cfg.vllm_kv_cache_bytes // per))


def decode_schedule(mfc: MFC, n: float, slots: int) -> tuple[float, float]:
    """(expected decode steps, expected sequence-steps) of ``n`` sequences on an engine
    with ``slots`` sequences at once (the prefill makes each sequence's first token).

    Example: lengths always 4, 8 sequences: 2 slots -> 6 x 4 / 2 + 4 - 1 = 15 steps;
    8 slots -> 3 steps; 24 sequence-steps either way."""
    cap = mfc.gen_len
    mean = mfc.lengths.expected() if mfc.lengths is not None else float(cap)

    def longest(rows: float) -> float:
        if mfc.lengths is None:
            return float(cap)
        return longest_moments(mfc.lengths, cap, rows)[0]
    if n <= slots:
        steps = longest(n) - 1.0
    else:
        steps = (n - slots) * mean / slots + longest(slots) - 1.0
    return max(0.0, steps), max(0.0, n * (mean - 1.0))


def host_step_terms(cm: "CostModel", steps: float) -> dict[str, float]:
    """The host's work between ``steps`` decode steps that the device waits for:
    ``decode_host_sync`` (:data:`VLLM_SYNC_STEP_S` a step) with the synchronous
    scheduler; with the asynchronous one, ``decode_host_gap`` (:data:`VLLM_ASYNC_STEP_GAP_S`
    a step) where the step is a replayed CUDA graph on a device that runs kernels
    asynchronously and no profile measured vLLM's decode (a profile's steps include
    their gaps; eager, the host's per-layer cost already paces the step); else nothing.

    Example: 1000 steps on an H100, async, graphs: {"decode_host_gap": 0.16}."""
    cfg = cm.config
    if cfg.vllm_scheduler == "sync":
        return {"decode_host_sync": steps * VLLM_SYNC_STEP_S}
    profiled = cm.profile is not None and VLLM_DECODE in cm.profile.engines
    if cm.cluster.device.async_kernels and not cfg.vllm_enforce_eager and not profiled:
        return {"decode_host_gap": steps * VLLM_ASYNC_STEP_GAP_S}
    return {}


def vllm_generate_cost(cm: "CostModel", mfc: MFC, spec: ModelSpec, head: str,
                       mesh: DeviceMesh, layout: Layout,
                       lora: LoraSpec | None = None) -> MFCCost:
    """Time and memory of ``mfc`` on vLLM (the module's docstring says what is priced);
    ``lora``: the model's adapters (vLLM's LoRA)."""
    if mfc.kind != "generate" or layout.pp != 1:
        raise ValueError("vLLM runs generate calls at PP 1 only")
    if lora is not None and lora.rank > VLLM_MAX_LORA_RANK:
        raise ValueError(f"vLLM takes LoRA ranks up to {VLLM_MAX_LORA_RANK}, not {lora.rank}")
    r, cfg = cm.rates, cm.config
    dt = cfg.param_dtype_bytes
    dp = layout.dp
    tpn, dpn, _ppn = cm.nodes_spanned(mesh, layout)
    n = mfc.n_seqs / dp
    slots = concurrency(cm, spec, mfc, layout.tp)
    if slots < 1:
        raise ValueError(f"vLLM's KV cache of {cfg.vllm_kv_cache_bytes:.3g} bytes holds no "
                         f"sequence of {mfc.seq_len} tokens")
    full = max(1.0, min(float(slots), n))
    # each engine holds every expert at the call's TP and exchanges no tokens: a
    # mixture of experts' passes are priced at EP 1 whatever the replica's EP
    engine = layout.model_copy(update={"ep": 1})
    P = longest_prompt(mfc, n)
    steps, seq_steps = decode_schedule(mfc, n, slots)
    pre_c, dec_c = r.engine(VLLM_PREFILL), r.engine(VLLM_DECODE)
    none = Work()
    (pre, _), = cm.stage_works(spec, head, "prefill", n * P, P / 2, n, engine, 1, none,
                               costs_kind=VLLM_PREFILL)
    ctx = P + (mfc.lengths.expected() if mfc.lengths is not None else mfc.gen_len) / 2
    (one, _), = cm.stage_works(spec, head, "decode", 1.0, ctx, 1.0, engine, 1, none,
                               costs_kind=VLLM_DECODE)
    (wide, _), = cm.stage_works(spec, head, "decode", full, ctx, full, engine, 1, none,
                                costs_kind=VLLM_DECODE)
    per_row = Work().add(wide).add(one, -1.0)
    decode = Work().add(one, steps).add(per_row, (seq_steps - steps) / max(1.0, full - 1.0))
    mine = dt * cm.lora_params(spec, head, layout, lora)   # realign's copy's adapters
    weights = dt * cm.stage_params(spec, head, layout) + mine
    whole = dt * cm.stage_params(spec, head, Layout(tp=1, pp=1, dp=1))
    n_out = mfc.gen_len
    adapters = dt * peft_adapter_params(spec, lora) if lora is not None else 0.0
    load = ({"adapter_load": adapter_load_s(cm, adapters, layout.tp, tpn)} if lora is not None
            else {"weight_load": weight_load_s(cm, whole, layout.tp, tpn)
                  + experts_gather_s(cm, spec, mesh, layout)})
    call = Work(seconds={"dp_comm": r.collective_s("all_gather", mfc.n_seqs * (2 * n_out + 1) * 8,
                                                   dp, dpn), **load},
                counts={"call_s": 1.0, "collective_s": float(dp > 1)})
    terms = {f"prefill_{k}": v for k, v in lagged(pre, layout.world).terms(pre_c).items()}
    for k, v in lagged(decode, layout.world).terms(dec_c).items():
        terms[f"decode_{k}"] = v
    terms.update(host_step_terms(cm, steps))
    for k, v in call.terms(pre_c).items():
        terms[k] = terms.get(k, 0.0) + v
    logit_cols = spec.padded_vocab if head == "lm" else 1.0
    # vLLM's base (every expert) and its copy of the adapters
    vllm_copy = dt * cm.stage_params(spec, head, engine) + adapters
    act = vllm_copy + cfg.vllm_kv_cache_bytes + 4.0 * full * logit_cols * 2
    return MFCCost(time_s=sum(terms.values()), terms_s=terms, weights_bytes=weights,
                   resident_bytes=weights, activation_bytes=act,
                   adapter_bytes=mine)
