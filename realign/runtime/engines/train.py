"""Training engine of one replica: megatron DDP, the distributed optimizer, gradient
clipping, micro-batches and the 1F1B pipeline schedule (pp > 1), all with the
replica's own process groups. The forward inside the schedule is megatron's
``GPTModel`` or the decoder's plain differentiable forward over the same parameters
(``TrainConfig.forward``; equal gradients are tested).

The loss is supplied by the algorithm: ``loss_fn(outputs, micro_batch) -> (loss,
metrics)`` where ``outputs`` are the per-token log-probs [b, s-1] (LM head) or values
[b, s] (value head) of the micro-batch, differentiable, zero past each length;
``loss`` is the micro-batch's mean loss (a scalar) and ``metrics`` a dict of scalar
tensors. A :class:`~realign.algorithms.common.TrainLoss` also says what the mean is
over (each row's weight: 1, or its tokens); a plain function is a mean over rows.

A step's micro-batches are the plan's equal row counts, or (``token_budget``, packed
training) first-fit-decreasing bins of at most that many tokens, of whole groups of
``group_size`` rows (preference pairs), as many as the rank's rows take: data-parallel
ranks may run different numbers. Either way each micro-batch's loss is scaled by its
share of the mini-batch's total weight (times the micro-batches and data-parallel
ranks that megatron's schedule and DDP average over), so the gradient is exactly that
of the loss's mean over the whole mini-batch: a token mean over all its tokens, a
sequence mean over all its rows, whatever the split. Metrics are weighted by rows.

A batch holding the rollout's experts (``routed_experts``: rollout routing replay,
:mod:`realign.runtime.router_replay`) trains with them forced in every sparse layer,
and logs ``moe.replay_mismatch``, the share of tokens whose experts in the forward
differ from them (0 where the replay holds).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from planner.graph.packing import group_bins
from realign.algorithms.common import TrainLoss, loss_weights
from realign.data.packing import Pack, train_packs
from realign.errors import UserError
from realign.runtime.device import cuda_tensor_type_names
from realign.runtime.engines.base import (
    Batch,
    check_batch,
    dp_rows,
    local_batch,
    position_ids,
    run_schedule,
)
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.engines.inference import head_outputs, packed_head_outputs
from realign.runtime.engines.optimizer_step import checked_step, use_fused_adam, world_is_replica
from realign.runtime.engines.packed_attention import kernel_for
from realign.runtime.engines.train_state import StateParking
from realign.runtime.model import ModelShard
from realign.runtime.moe import recording, router_terms
from realign.runtime.moe_stages import attach_loss, stage_aux_weight, sum_stage_metric
from realign.runtime.optimizer_state import torch_optimizers
from realign.runtime.router_replay import ROUTED_EXPERTS, replay_mismatch, replaying_batch
from realign.runtime.settings import TrainConfig

LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TrainEngine:
    """``train_step(batch, loss_fn)`` for one replica, each step in ``micro_batches``
    micro-batches per DP rank (the plan's), or packed into bins of at most
    ``token_budget`` tokens of whole ``group_size`` row groups (the plan's token
    budget; packed training only). Every rank of the replica calls it with the same
    whole batch; the returned metrics are the same on every rank."""

    def __init__(self, shard: ModelShard, cfg: TrainConfig, micro_batches: int = 1,
                 optimizer_offload: bool = False, recompute: bool = False,
                 state_offload: bool = False, token_budget: int | None = None,
                 group_size: int = 1):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if token_budget is not None and not (cfg.packing and cfg.forward != "megatron"):
            raise UserError(
                f"a train call's token budget ({token_budget} tokens) packs its rows into "
                f"bins: it needs train.packing true and the plain forward (this run: packing "
                f"{cfg.packing}, forward {cfg.forward}); plan again with these settings",
                field="train.packing")
        if token_budget is not None and shard.groups.ep > 1:
            # the bins' count differs between data-parallel ranks, but every rank of an EP
            # group must run each micro-batch's token exchange
            raise UserError(
                f"a train call's token budget ({token_budget} tokens) gives each "
                f"data-parallel rank its own number of micro-batches, which expert "
                f"parallelism (ep {shard.groups.ep}) cannot run: its ranks exchange tokens "
                "in every micro-batch; plan the call with ep 1 or without a token budget",
                field="plan.token_budget")
        self.shard, self.cfg, self.micro_batches = shard, cfg, micro_batches
        self.token_budget, self.group_size = token_budget, group_size
        self.optimizer_offload, self.recompute = optimizer_offload, recompute
        pgs, dev, config = shard.groups.pgs, shard.device, shard.config
        if optimizer_offload and (dev.kind != "cuda" or not cfg.uses_distributed_optimizer(
                dev.kind)):
            raise UserError(
                "optimizer offload moves the distributed optimizer's state from the GPU to "
                "host memory: it needs device cuda and train.distributed_optimizer on (this "
                f"run: device {dev.kind}, distributed optimizer "
                f"{cfg.uses_distributed_optimizer(dev.kind)}); plan with "
                "plan.cost.optimizer_offload: never", field="plan.cost.optimizer_offload")
        if recompute and cfg.forward == "megatron":
            # megatron's layers: full recomputation of every layer in the backward
            config.recompute_granularity, config.recompute_method = "full", "uniform"
            config.recompute_num_layers = 1
        #: a mixture of experts: its router's loss coefficient (load metrics with it)
        self.router_coef = _router_coef(shard, cfg, recompute)
        self.zero1 = zero1 = cfg.uses_distributed_optimizer(dev.kind)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=zero1)
        self.model = DistributedDataParallel(config, ddp_config, shard.module,
                                             pg_collection=pgs)
        opt_config = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad, bf16=dev.dtype == torch.bfloat16,
            params_dtype=dev.dtype, use_distributed_optimizer=zero1,
            # the plan's optimizer offload: megatron's HybridDeviceOptimizer keeps the
            # fp32 main weights and Adam moments in host memory and steps them there
            # (offload fraction 1: all of them); gradients go down, new weights up
            **({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}
               if optimizer_offload else {}))
        with cuda_tensor_type_names(dev), world_is_replica(shard.groups.model_group):
            self.optimizer = get_megatron_optimizer(
                opt_config, [self.model], use_gloo_process_groups=False, pg_collection=pgs)
        if dev.kind == "cpu":
            for opt in torch_optimizers(self.optimizer):
                use_fused_adam(opt)
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        self.plain = cfg.forward != "megatron"
        #: packed micro-batches (train.packing; the plain forward only, TrainConfig checks)
        self.packing = cfg.packing and self.plain
        #: the plan's training-state offload: parked between train calls (train_state.py)
        self.parking = (StateParking(self.model, self.optimizer, shard.module, dev.device)
                        if state_offload else None)

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One train call (its optimizer steps): the parked state comes back before it
        and is parked after it when the plan offloads it; a train call that fails
        leaves it on the device (the run stops)."""
        if self.parking is not None:
            self.parking.unpark()
        yield
        if self.parking is not None:
            self.parking.park()

    @contextlib.contextmanager
    def state_on_device(self) -> Iterator[None]:
        """The training state on the device while a checkpoint reads or writes it; parked
        again after when the plan offloads it (and it was parked before)."""
        parked = self.parking if self.parking is not None and self.parking.parked else None
        if parked is not None:
            parked.unpark()
        try:
            yield
        finally:
            if parked is not None:
                parked.park()

    def train_step(self, batch: Batch, loss_fn: LossFn | TrainLoss, dp_mean: bool = True
                   ) -> dict[str, float]:
        """One optimiser step over the batch; returns ``loss``, ``grad_norm``,
        ``update_ok`` and the loss function's metrics (means over micro-batches and DP).

        ``dp_mean=False`` skips the collectives that average the loss metrics: they are
        then this DP rank's means, returned on the last pipeline stage only (other
        stages get ``grad_norm`` and ``update_ok``, which are global), for a caller
        that averages them over DP itself (the controller does, from each DP rank's
        report)."""
        shard = self.shard
        check_batch(batch, shard, self.micro_batches if self.token_budget is None else 1)
        if ROUTED_EXPERTS in batch and self.recompute and not self.plain:
            raise UserError(
                "megatron's recomputed layers rerun their forward in the backward, after "
                "the rollout's experts are no longer set, so routing replay cannot hold "
                "there; use train.forward plain (its recomputation replays) or "
                "rollout.routing_replay off", field="rollout.routing_replay")
        local = local_batch(batch, shard)
        parts = self.micro_rows(local["lengths"])
        micro = [{k: v[rows] for k, v in local.items()} for rows in parts]
        scales = loss_scales(loss_weights(loss_fn)(batch), dp_rows(shard, len(batch["lengths"])),
                             parts, shard.groups.layout.dp)
        if not self.model.training:      # a recursive walk over every module otherwise
            self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        s = micro[0]["tokens"].shape[1]
        forward = self._plain_forward(s) if self.plain else None
        packs = train_packs(micro, kernel_for(shard.device.kind)) if self.packing else None
        cols = s - (shard.head == "lm")

        g = shard.groups
        stage_aux: list[torch.Tensor] = []    #: this stage's logged router loss per mb

        def forward_step(data_iterator, model):
            mb, pack, (scale, share) = next(data_iterator)
            mb_routed = mb.get(ROUTED_EXPERTS)       # rollout routing replay
            with (recording(shard.module) if self.router_coef is not None
                  else contextlib.nullcontext()) as record, \
                    replaying_batch(shard, mb_routed, pack, seq_first=forward is None):
                if forward is None:
                    out = model(mb["tokens"], position_ids(mb["tokens"]), None)
                elif pack is None:
                    out = forward(mb["tokens"])
                else:
                    out = forward(pack.tokens, pack)
            aux, routed = None, {}
            if record is not None and record.probs and self.router_coef is not None:
                # this stage's sparse layers, weighted by their share (moe_stages)
                w = stage_aux_weight(shard.spec, g.layout.pp, g.pp_rank)
                aux, routed = router_terms(record, token_mask(mb, pack, forward is None),
                                           self.router_coef)
                aux, routed["router_aux_loss"] = aux * w, routed["router_aux_loss"] * w
                if mb_routed is not None:   # experts the replay forced, against the rollout's
                    differ, compared = replay_mismatch(record, mb_routed, shard, pack,
                                                       seq_first=forward is None)
                    routed["moe.replay_mismatch"] = torch.tensor(differ / max(1, compared))
                if not g.is_last_stage:    # megatron's schedule divides the loss by mbs
                    out = attach_loss(out, aux * scale / len(micro))
                    stage_aux.append(routed["router_aux_loss"] * share)

            def loss_func(output):
                outputs = (head_outputs(shard, output, mb) if pack is None
                           else packed_head_outputs(shard, output, pack, cols))
                loss, metrics = loss_fn(outputs, mb)
                if aux is not None:
                    loss, metrics = loss + aux, {**metrics, **routed}
                elif self.router_coef is not None:    # a last stage of dense layers only
                    metrics = {**metrics, "router_aux_loss": torch.zeros(())}
                loss = loss * scale     # its share of the mini-batch's mean
                return loss, {"loss": loss.detach().clone(),
                              **{k: torch.as_tensor(v).detach() * share
                                 for k, v in metrics.items()}}
            return out, loss_func

        pack_of: list[Pack | None] = list(packs) if packs else [None] * len(micro)
        reduced = run_schedule(shard, self.model, forward_step,
                               list(zip(micro, pack_of, scales)),
                               forward_only=False, collect_non_loss_data=False,
                               shape=packs[0].shape if packs else micro[0]["tokens"].shape)
        if self.router_coef is not None and g.layout.pp > 1:
            sum_stage_metric(reduced, "router_aux_loss", stage_aux, len(micro), g.pgs.pp,
                             shard.device.device)
        with cuda_tensor_type_names(self.shard.device):
            update_ok, grad_norm = checked_step(self.optimizer)
        metrics = self._reduce_metrics(reduced) if dp_mean else _local_means(reduced)
        metrics["grad_norm"] = grad_norm
        metrics["update_ok"] = float(bool(update_ok))
        return metrics

    def micro_rows(self, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Row indices of each micro-batch of this rank's rows of ``lengths``: the
        plan's equal split, or with a token budget the bins of
        :func:`planner.graph.packing.group_bins`."""
        rows = len(lengths)
        if self.token_budget is None:
            return list(torch.arange(rows, device=lengths.device).chunk(self.micro_batches))
        lens = [int(x) for x in lengths.tolist()]
        try:
            bins = group_bins(lens, self.group_size, self.token_budget)
        except ValueError as e:
            raise UserError(f"the train call's rows do not pack into its token budget: {e}",
                            field="plan.token_budget") from None
        return [torch.tensor(b, dtype=torch.long, device=lengths.device) for b in bins]

    def _plain_forward(self, seq_len: int) -> Callable[..., torch.Tensor]:
        """tokens [b, s] (or a pack's [bins, width] and the pack) -> this stage's output
        as megatron's ``GPTModel`` gives it inside the schedule: head output [b, s, .]
        on the last stage, hidden states [s, b, h] (sequence-first, what the schedule
        sends) on the others. A later
        stage's input is what the schedule set with ``set_input_tensor``."""
        shard = self.shard
        g = shard.groups
        decoder: Any = shard.module.decoder     # megatron's TransformerBlock
        dec = StageDecoder(shard, max_len=seq_len, recompute=self.recompute)

        def forward(tokens: torch.Tensor, pack: Pack | None = None) -> torch.Tensor:
            x = tokens if g.is_first_stage else decoder.input_tensor.transpose(0, 1)
            out = dec.score(x, pack)
            return out if g.is_last_stage else out.transpose(0, 1).contiguous()
        return forward

    def _reduce_metrics(self, reduced: list[dict]) -> dict[str, float]:
        """Mean over micro-batches (last stage), then over DP; broadcast over PP."""
        g = self.shard.groups
        dev = self.shard.device.device
        names: list[list[str] | None] = [sorted(reduced[0]) if reduced else None]
        if g.layout.pp > 1:
            src = g.world_rank(g.tp_rank, g.dp_rank, g.layout.pp - 1)
            dist.broadcast_object_list(names, src=src, group=g.pgs.pp)
        keys = names[0]
        assert keys is not None             # the last stage's metric names
        if g.is_last_stage:
            vals = torch.stack([torch.stack([r[k].float().to(dev) for r in reduced]).mean()
                                for k in keys])
        else:
            vals = torch.empty(len(keys), device=dev)
        if g.layout.pp > 1:
            dist.broadcast(vals, src=src, group=g.pgs.pp)
        if g.layout.dp > 1:
            dist.all_reduce(vals, group=g.pgs.dp)
            vals /= g.layout.dp
        return {k: float(v) for k, v in zip(keys, vals)}


def _router_coef(shard: ModelShard, cfg: TrainConfig, recompute: bool) -> float | None:
    """The router's load-balancing loss coefficient of a mixture of experts (None: a
    dense model); at PP > 1 summed over the stages (:mod:`realign.runtime.moe_stages`).
    Megatron's recomputed layers run their first forward without gradients, which the
    loss needs."""
    moe = shard.spec.moe
    if moe is None:
        return None
    if moe.router_aux_loss_coef > 0 and recompute and cfg.forward == "megatron":
        raise UserError(
            "megatron's recomputed layers run their forward without gradients, so the "
            "router's load-balancing loss would not train the router; use train.forward "
            "plain (it recomputes with gradients) or plan.cost.recompute never",
            field="train.forward")
    return moe.router_aux_loss_coef


def token_mask(mb: Batch, pack: Pack | None, megatron: bool) -> torch.Tensor:
    """Where the training forward's token grid holds a real token: a pack's [bins,
    width] positions of a row; else [b, s] positions before each row's length ([s, b]
    in megatron's sequence-first layers)."""
    if pack is not None:
        return pack.doc >= 0
    s = mb["tokens"].shape[1]
    mask = torch.arange(s, device=mb["tokens"].device) < mb["lengths"][:, None]
    return mask.t() if megatron else mask


def loss_scales(weights: torch.Tensor, mine: slice, parts: list[torch.Tensor], dp: int
                ) -> list[tuple[float, float]]:
    """(loss scale, metric scale) of each of this data-parallel rank's micro-batches.

    ``weights`` [b] are every row's count in the loss's normaliser over the whole
    mini-batch, ``mine`` this rank's rows and ``parts`` its micro-batches' row indices
    within them. megatron's schedule divides each micro-batch's loss by this rank's
    micro-batch count ``n`` and DDP averages the ``dp`` ranks' gradients, so a loss
    scaled by ``W_mb / W x n x dp`` gives the gradient of sum over micro-batches of
    ``W_mb / W x mean_mb``: the mean over the mini-batch. A metric is scaled by
    ``rows_mb / rows x n``: the mean over micro-batches is then weighted by rows.

    Example: weights [1, 1, 3, 3] (a token mean), one rank, micro-batches [0, 1] and
    [2, 3]: loss scales 2/8 x 2 = 0.5 and 6/8 x 2 = 1.5; metric scales 1 and 1. A
    mini-batch without weight (no token counts): loss scales 0."""
    total = float(weights.sum())
    local = weights[mine]
    n, rows = len(parts), sum(len(p) for p in parts)
    return [((float(local[p.cpu()].sum()) / total if total > 0 else 0.0) * n * dp,
             len(p) * n / rows) for p in parts]


def _local_means(reduced: list[dict]) -> dict[str, float]:
    """Each loss metric's mean over this rank's micro-batches (empty off the last
    stage, where the schedule returns nothing)."""
    if not reduced:
        return {}
    keys = sorted(reduced[0])
    # a metric may live on the host (the MoE router's expert load) while the loss is on
    # the accelerator: gather all on the host, one copy per micro-batch
    vals = torch.stack([torch.stack([r[k].detach().float().cpu() for r in reduced])
                        for k in keys])
    return dict(zip(keys, vals.mean(dim=1).tolist()))
