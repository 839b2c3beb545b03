"""The cost model: time and memory of one MFC under one allocation, as realign's
engines execute it.

Time (seconds) composes passes of one micro-batch through one pipeline stage
(:func:`planner.cost.engine_terms.stage_pass`: GEMMs, attention, TP collectives and the
engine's fixed costs) with the rates of :class:`planner.cost.rates.Rates` (a profile's
measurements where it has them, the device preset's otherwise). Per data-parallel
rank, with ``m`` micro-batches, ``pp`` stages and the slot of a micro-batch = the
slowest stage's pass plus its point-to-point send:

* inference: ``call + (m + pp - 1) slots`` (the first micro-batch fills the pipeline),
  then the results gathered over DP (all-gather) and broadcast from the last stage;
* train, per optimizer step: ``call + (m + pp - 1) slots`` of forward + backward, the
  DP gradient reduction in fp32 (all-reduce, or with the distributed optimizer a
  reduce-scatter plus an all-gather of the new weights), the global grad-norm
  all-reduces (model-parallel group), and the optimizer's ``param_s`` per local
  parameter; times mini-batches x epochs;
* generate, in waves or in slots that refill (``MFC.refill``):
  :mod:`planner.cost.generate_terms`; then the output gathered over DP.

A wave prefills its prompts padded to its longest, and inference and training of a
rollout read its rows padded to the batch's longest: they are priced at the expected
padded lengths (:mod:`planner.graph.padding`), their memory at the caps ``prompt_len`` and
``gen_len`` (a step may reach them).

On a device that runs kernels asynchronously (``DeviceSpec.async_kernels``: GPUs) the
host's fixed costs and the device's work of one stage pass overlap: the pass costs the
longer of the two (:func:`planner.cost.engine_terms.overlapped`); the per-call and per-step
costs still add.

Memory (bytes per GPU): :mod:`planner.cost.memory`. How the passes of a call compose
(pipelines, decode steps, a micro-batch's tokens): :mod:`planner.cost.passes`.

LoRA (a role's :class:`~planner.specs.lora.LoraSpec`): the weights add the adapters;
gradients, optimizer state, the DP gradient sync and the optimizer's step count the
adapters only (and a value head: :meth:`CostModel.trainable_params`); every pass adds the
adapter GEMMs, and training drops the base's weight-gradient GEMMs
(:func:`planner.cost.engine_terms.stage_pass`). ``MFCCost.adapter_bytes`` is what a
reallocation of the model moves once its frozen base is in place (docs/lora.md).
"""
from __future__ import annotations

from dataclasses import replace

from planner.cost.cost_config import CostModelConfig
from planner.cost.engine_terms import Work, lagged, overlapped, stage_pass
from planner.cost.generate_terms import refill_terms, wave_terms
from planner.cost.lora_terms import adapter_params
from planner.cost.memory import (
    kv_cache_bytes,
    mfc_memory,
    optimizer_shard_params,
    stage_expert_params,
    stage_params,
    trainable_params,
)
from planner.cost.mfc_cost import MFCBytes, MFCCost
from planner.cost.offload_terms import offload_step_s, state_transfer_s
from planner.cost.passes import (
    messages,
    micro_batch_tokens,
    pipelined,
    work_key,
)
from planner.cost.peer_engines import train_engine_options
from planner.cost.profile import ProfileTable
from planner.cost.rates import Rates
from planner.cost.turns import multi_turn_cost
from planner.cost.vllm_cost import generate_engine_options, vllm_generate_cost
from planner.graph.dataflow import MFC
from planner.graph.packing import budget_shape
from planner.graph.padding import padded_len
from planner.specs.cluster import ClusterSpec
from planner.specs.layout import Layout
from planner.specs.lora import LoraSpec
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec


def group_nodes(group: list[int], mesh: DeviceMesh, gpus_per_node: int) -> int:
    """How many nodes the mesh ranks of ``group`` live on."""
    return len({(mesh.first_gpu + r) // gpus_per_node for r in group})


class CostModel:
    """Time and memory of MFCs on a cluster (rates: device preset, or a profile)."""

    def __init__(self, cluster: ClusterSpec, config: CostModelConfig | None = None,
                 profile: ProfileTable | None = None):
        self.cluster = cluster
        self.config = config or CostModelConfig()
        self.profile = profile
        self.rates = Rates(cluster, self.config, profile)
        #: one pass of a micro-batch through a stage, by everything it depends on: the
        #: search prices many candidates whose passes are alike (the same rows per
        #: replica on meshes of other sizes); the Works kept here are only read
        self._stage_memo: dict[tuple[tuple[object, ...], bool, bool], Work] = {}
        #: a packed call's bins per (call, rows per rank, budget): the same for every
        #: layout of one dp (expert parallelism's candidates among them)
        self._budget_memo: dict[tuple[MFC, float, int], tuple[int, float, float]] = {}
        #: a train call's terms by everything they depend on (:meth:`mfc_cost`)
        self._train_memo: dict[tuple[object, ...], dict[str, float]] = {}

    @property
    def mem_limit_bytes(self) -> float:
        return self.cluster.device.mem_bytes * self.config.mem_usable_fraction

    # ---- sizes (planner.cost.memory) ----------------------------------------------
    stage_params = staticmethod(stage_params)
    trainable_params = staticmethod(trainable_params)
    lora_params = staticmethod(adapter_params)

    def kv_cache_bytes(self, spec: ModelSpec, mfc: MFC, layout: Layout, waves: int) -> float:
        """:func:`planner.cost.memory.kv_cache_bytes` under this model's configuration."""
        return kv_cache_bytes(self.config, spec, mfc, layout, waves)

    # ---- helpers -----------------------------------------------------------------
    def nodes_spanned(self, mesh: DeviceMesh, layout: Layout) -> tuple[int, int, int]:
        """Nodes spanned by one TP, DP and PP group of ``layout`` on ``mesh``."""
        gpn = self.cluster.gpus_per_node
        # the first group of each kind (meshes are aligned, so every group of a kind
        # spans as many nodes): TP ranks 0.., DP ranks 0, tp, 2 tp.., PP 0, tp dp, ...
        tp, dp, pp = layout.tp, layout.dp, layout.pp
        return (group_nodes(list(range(tp)), mesh, gpn),
                group_nodes(list(range(0, tp * dp, tp)), mesh, gpn),
                group_nodes(list(range(0, tp * dp * pp, tp * dp)), mesh, gpn))

    def expert_dp_nodes(self, mesh: DeviceMesh, layout: Layout) -> int:
        """Nodes spanned by one expert-data-parallel group (the ranks holding the same
        experts: data-parallel ranks 0, ep, 2 ep, ..: mesh ranks 0, tp ep, ..)."""
        step = layout.tp * layout.ep
        return group_nodes(list(range(0, layout.tp * layout.dp, step)), mesh,
                           self.cluster.gpus_per_node)

    def ep_nodes(self, mesh: DeviceMesh, layout: Layout) -> int:
        """Nodes spanned by one EP group of ``layout`` on ``mesh`` (data-parallel ranks
        0 .. ep-1 of one (tp, pp) position: mesh ranks 0, tp, .., (ep-1) tp)."""
        return group_nodes(list(range(0, layout.tp * layout.ep, layout.tp)), mesh,
                           self.cluster.gpus_per_node)

    def stage_works(self, spec: ModelSpec, head: str, kind: str, rows: float, ctx: float,
                    out_rows: float, layout: Layout, tp_nodes: int, msg: Work,
                    back: Work | None = None, recompute: bool = False,
                    costs_kind: str | None = None, lora: LoraSpec | None = None,
                    ep_nodes: int = 1) -> list[tuple[Work, int]]:
        """(work, how many stages do it) of one micro-batch's pass through each stage:
        the first (embedding), the middle ones, the last (head); every stage but the
        last also sends ``msg`` on, and with ``back`` the last sends that back (decode:
        the chosen tokens). ``costs_kind``: whose fixed costs overlap the device's work
        on an asynchronous device (default ``kind``'s: realign's engine; vLLM's steps
        pass theirs). ``ep_nodes``: the nodes one EP group spans (:meth:`ep_nodes`)."""
        tp, pp, ep = layout.tp, layout.pp, layout.ep
        layers = spec.n_layers // pp
        r = self.rates
        costs_kind = costs_kind or kind
        signature = (spec, head, kind, rows, ctx, out_rows, tp, pp, tp_nodes, recompute,
                     work_key(msg), work_key(back) if back is not None else None,
                     costs_kind, lora, ep, ep_nodes)

        def stage(first: bool, last: bool) -> Work:
            key = (signature, first, last)
            hit = self._stage_memo.get(key)
            if hit is None:
                hit = self._stage_memo[key] = make(first, last)
            return hit

        def make(first: bool, last: bool) -> Work:
            w = stage_pass(r, spec, head, kind, rows, ctx, out_rows, tp, layers, first, last,
                           tp_nodes, lora, ep, ep_nodes)
            if kind == "train" and recompute:
                # the backward first runs each layer's forward again (no head, no
                # embedding): its GEMMs, attention and TP collectives
                again = stage_pass(r, spec, head, "inference", rows, ctx, 0.0, tp, layers,
                                   False, False, tp_nodes, lora, ep, ep_nodes)
                again.counts = {k: v for k, v in again.counts.items()
                                if k in ("layer_s", "collective_s", "kernel_extra")}
                w.add(again)
            if not last:
                w.add(msg)
            elif back is not None and pp > 1:
                w.add(back)
            if self.cluster.device.async_kernels:
                w = overlapped(w, r.engine(costs_kind))
            return w
        if pp == 1:
            return [(stage(True, True), 1)]
        out = [(stage(True, False), 1)]
        if pp > 2:
            out.append((stage(False, False), pp - 2))
        out.append((stage(False, True), 1))
        return out

    # ---- the MFC cost ------------------------------------------------------------
    def recompute_options(self, mfc: MFC) -> tuple[bool, ...]:
        """The activation-recompute settings to price for ``mfc`` (train only)."""
        mode = self.config.recompute
        if mfc.kind != "train" or mode == "never":
            return (False,)
        return (True,) if mode == "always" else (False, True)

    def engine_options(self, mfc: MFC, layout: Layout, micro_batches: int) -> tuple[str, ...]:
        """The engines to price for ``mfc`` under ``layout``: a scoring or training
        call's, :func:`~planner.cost.peer_engines.train_engine_options` (``train_engine``);
        a generate call's, :func:`~planner.cost.vllm_cost.generate_engine_options`
        (``generate_engine``)."""
        if mfc.kind != "generate":
            return train_engine_options(self.config.train_engine, layout)
        return generate_engine_options(self.config.generate_engine, layout, micro_batches)

    def mfc_cost(self, mfc: MFC, spec: ModelSpec, head: str, mesh: DeviceMesh,
                 layout: Layout, micro_batches: int, offload: bool = False,
                 state_offload: bool = False, recompute: bool = False,
                 engine: str = "own", lora: LoraSpec | None = None,
                 token_budget: int | None = None,
                 memory: MFCBytes | None = None) -> MFCCost:
        """``lora``: the role trains (and runs) LoRA adapters on a frozen base.
        ``token_budget``: a packed scoring or training call packs each data-parallel
        rank's rows (a training call: those of one optimizer step) into bins of at most
        that many tokens (:func:`planner.graph.packing.budget_shape` prices them;
        ``micro_batches`` is then not read). ``memory``: :meth:`mfc_bytes` of the same
        arguments where the caller has it already (not computed again)."""
        if token_budget is not None and not (mfc.kind in ("inference", "train")
                                             and mfc.packed):
            raise ValueError(f"a token budget applies to packed scoring and training calls "
                             f"only, not to {mfc.name} ({mfc.kind}, packed {mfc.packed})")
        if (offload or state_offload or recompute) and mfc.kind != "train":
            raise ValueError("optimizer and training-state offload and activation "
                             "recompute apply to train MFCs only")
        if mfc.sampling_rounds != 1.0:     # DAPO's sampling rounds: that many passes
            one = self.mfc_cost(mfc.model_copy(update={"sampling_rounds": 1.0}), spec, head,
                                mesh, layout, micro_batches, offload, state_offload,
                                recompute, engine, lora, token_budget, memory)
            return replace(one, time_s=one.time_s * mfc.sampling_rounds,
                           terms_s={k: v * mfc.sampling_rounds for k, v in one.terms_s.items()})
        if mfc.turns is not None:          # multi-turn episodes: priced turn by turn
            return multi_turn_cost(mfc, lambda sub: self.mfc_cost(
                sub, spec, head, mesh, layout, micro_batches, engine=engine, lora=lora))
        if engine == "vllm":
            return vllm_generate_cost(self, mfc, spec, head, mesh, layout, lora)
        if mfc.kind == "generate":
            terms = self._generate_terms(mfc, spec, head, mesh, layout, micro_batches, lora)
        elif mfc.kind == "train":
            # the same with and without training-state offload (which adds its own term):
            # computed once for both
            key = (mfc, spec, head, mesh.first_gpu, mesh.n_gpus, layout, micro_batches,
                   offload, recompute, lora, token_budget)
            hit = self._train_memo.get(key)
            if hit is None:
                hit = self._train_memo[key] = self._train_terms(
                    mfc, spec, head, mesh, layout, micro_batches, offload, recompute, lora,
                    token_budget)
            terms = dict(hit)
        else:
            terms = self._inference_terms(mfc, spec, head, mesh, layout, micro_batches, lora,
                                          token_budget)
        b = memory if memory is not None else self._own_bytes(
            mfc, spec, head, layout, micro_batches, offload, state_offload, recompute, lora,
            token_budget)
        if state_offload:
            terms["state_offload"] = state_transfer_s(self.rates, b.kept_bytes)
        return MFCCost(time_s=sum(terms.values()), terms_s=terms, weights_bytes=b.weights_bytes,
                       resident_bytes=b.resident_bytes, activation_bytes=b.activation_bytes,
                       host_bytes=b.host_bytes, adapter_bytes=b.adapter_bytes)

    def mfc_bytes(self, mfc: MFC, spec: ModelSpec, head: str, mesh: DeviceMesh,
                  layout: Layout, micro_batches: int, offload: bool = False,
                  state_offload: bool = False, recompute: bool = False,
                  engine: str = "own", lora: LoraSpec | None = None,
                  token_budget: int | None = None) -> MFCBytes | MFCCost:
        """The memory of :meth:`mfc_cost` with the same arguments, its fields equal to
        that cost's, without pricing the time where the memory does not need it: realign's
        own engines' calls (the search drops what does not fit before it prices the time,
        passing this as ``mfc_cost``'s ``memory``).
        A vLLM or multi-turn call's memory comes from its whole price: that
        :class:`MFCCost` is returned (its time with it)."""
        if engine == "vllm" or mfc.turns is not None:
            return self.mfc_cost(mfc, spec, head, mesh, layout, micro_batches, offload,
                                 state_offload, recompute, engine, lora, token_budget)
        # DAPO's sampling rounds scale the time only (mfc_cost prices one round)
        one = mfc if mfc.sampling_rounds == 1.0 else mfc.model_copy(
            update={"sampling_rounds": 1.0})
        return self._own_bytes(one, spec, head, layout, micro_batches, offload, state_offload,
                               recompute, lora, token_budget)

    def _own_bytes(self, mfc: MFC, spec: ModelSpec, head: str, layout: Layout,
                   micro_batches: int, offload: bool, state_offload: bool, recompute: bool,
                   lora: LoraSpec | None, token_budget: int | None) -> MFCBytes:
        """Memory per GPU of a call on realign's own engines (:func:`planner.cost.memory.
        mfc_memory`, the adapters among the weights, training-state offload's moves)."""
        weights, resident, act, host = mfc_memory(self.config, mfc, spec, head, layout,
                                                  micro_batches, offload, recompute, lora,
                                                  token_budget)
        adapters = self.config.param_dtype_bytes * self.lora_params(spec, head, layout, lora)
        kept = 0.0
        if state_offload:
            # everything but the weights is there only while the call runs; what is
            # kept (not the gradients: zeroed each step anyway) goes down and up again
            kept = resident - weights - self.trainable_params(spec, head, layout, lora) * (
                self.config.grad_dtype_bytes)
            act += resident - weights
            resident = weights
            host += kept
        return MFCBytes(weights, resident, act, host, adapters, kept)

    def _budget_shape(self, mfc: MFC, rows: float, budget: int) -> tuple[int, float, float]:
        """:func:`planner.graph.packing.budget_shape`, computed once per argument."""
        key = (mfc, rows, budget)
        hit = self._budget_memo.get(key)
        if hit is None:
            hit = self._budget_memo[key] = budget_shape(mfc, rows, budget)
        return hit

    def _inference_terms(self, mfc: MFC, spec: ModelSpec, head: str, mesh: DeviceMesh,
                         layout: Layout, m: int, lora: LoraSpec | None = None,
                         token_budget: int | None = None) -> dict[str, float]:
        r, dt = self.rates, self.config.param_dtype_bytes
        pp, dp = layout.pp, layout.dp
        tpn, dpn, ppn = self.nodes_spanned(mesh, layout)
        n_local = mfc.n_seqs / dp
        s = padded_len(mfc)     # the batch padded to its longest
        if token_budget is None:
            tok, ctx = micro_batch_tokens(mfc, n_local / m, m, dp)
        else:
            m, tok, ctx = self._budget_shape(mfc, n_local, token_budget)
        costs = r.engine("inference")
        # per micro-batch and stage boundary: its hidden states to the next stage
        msg = messages(r.collective_s("p2p", tok * spec.hidden * dt, 2, ppn))
        stages = self.stage_works(spec, head, "inference", tok, ctx, tok, layout, tpn, msg,
                                  lora=lora, ep_nodes=self.ep_nodes(mesh, layout))
        out_cols = s - 1 if head == "lm" else s
        call = Work(seconds={"dp_comm": (
            r.collective_s("all_gather", mfc.n_seqs * out_cols * 4, dp, dpn)
            + (r.collective_s("broadcast", n_local * out_cols * 4, pp, ppn) if pp > 1 else 0.0))},
            counts={"call_s": 1.0, "collective_s": float((dp > 1) + (pp > 1))})
        return lagged(pipelined(stages, m, costs).add(call), layout.world).terms(costs)

    def _train_terms(self, mfc: MFC, spec: ModelSpec, head: str, mesh: DeviceMesh,
                     layout: Layout, m: int, offload: bool = False,
                     recompute: bool = False, lora: LoraSpec | None = None,
                     token_budget: int | None = None) -> dict[str, float]:
        r, cfg, dt = self.rates, self.config, self.config.param_dtype_bytes
        tp, pp, dp = layout.tp, layout.pp, layout.dp
        tpn, dpn, ppn = self.nodes_spanned(mesh, layout)
        steps = mfc.n_minibatches * mfc.n_epochs
        rows = mfc.n_seqs / mfc.n_minibatches / dp      # one optimizer step's, per rank
        if token_budget is None:
            tok, ctx = micro_batch_tokens(mfc, rows / m, m, dp)
        else:
            m, tok, ctx = self._budget_shape(mfc, rows, token_budget)
        costs = r.engine("train")
        # per micro-batch and stage boundary: activations forward, their gradients back
        msg = messages(r.collective_s("p2p", tok * spec.hidden * dt, 2, ppn), 2)
        stages = self.stage_works(spec, head, "train", tok, ctx, tok, layout, tpn, msg,
                                  recompute=recompute, lora=lora,
                                  ep_nodes=self.ep_nodes(mesh, layout))
        # what has gradients, an optimizer state and new values: every parameter, or the
        # adapters (and a value head) with LoRA
        p_gpu = self.trainable_params(spec, head, layout, lora)
        # with expert parallelism the experts' gradients are summed over the dp / ep
        # ranks that hold the same experts, the dense ones over dp
        experts = stage_expert_params(spec, layout) if layout.ep > 1 else 0.0
        groups = [(p_gpu - experts, dp, dpn)]
        if experts:
            groups.append((experts, dp // layout.ep, self.expert_dp_nodes(mesh, layout)))
        sync, n_sync = 0.0, 0
        for params, n, nodes in groups:
            if cfg.distributed_optimizer:   # reduce-scatter grads, all-gather new weights
                sync += (r.collective_s("reduce_scatter", cfg.grad_dtype_bytes * params, n,
                                        nodes)
                         + r.collective_s("all_gather", dt * params, n, nodes))
                n_sync += 2 * (n > 1)
            else:
                sync += r.collective_s("all_reduce", cfg.grad_dtype_bytes * params, n, nodes)
                n_sync += 1 * (n > 1)
        # the global grad norm: an all-reduce over the model-parallel ranks (and the
        # DP ranks when the gradients are sharded), twice (norm, then clipping's check)
        mp = tp * pp * (dp if cfg.distributed_optimizer else 1)
        mp_nodes = max(tpn, ppn, dpn if cfg.distributed_optimizer else 1)
        norm = 2 * r.collective_s("all_reduce", 8, mp, mp_nodes) if mp > 1 else 0.0
        shard = optimizer_shard_params(spec, layout, p_gpu, cfg.distributed_optimizer)
        per_step = Work(seconds={"dp_grad_sync": sync + norm},
                        counts={"call_s": 1.0, "collective_s": float(n_sync + 2 * (mp > 1)),
                                "param_s": 0.0 if offload else shard})
        if offload:     # the host steps the shard instead of the GPU
            host_s = offload_step_s(self.config, self.cluster.device, self.rates, shard)
            per_step.add(Work(seconds={"optimizer_offload": host_s}))
        step = lagged(pipelined(stages, m, costs).add(per_step), layout.world)
        return Work().add(step, steps).terms(costs)

    def _generate_terms(self, mfc: MFC, spec: ModelSpec, head: str, mesh: DeviceMesh,
                        layout: Layout, m: int, lora: LoraSpec | None = None
                        ) -> dict[str, float]:
        """In waves, or in slots that refill (:mod:`planner.cost.generate_terms`)."""
        terms = refill_terms if mfc.refill else wave_terms
        return terms(self, mfc, spec, head, mesh, layout, m, lora)
