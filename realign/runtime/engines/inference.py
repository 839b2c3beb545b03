"""Inference engine of one replica: per-token log-probs of given token ids (LM head:
actor, reference) or per-token values and sequence scores (value head: critic,
reward model), over right-padded variable-length sequences.

Scoring needs no autograd, so it runs the generation decoder's plain forward
(:class:`~realign.runtime.engines.decoder.StageDecoder`, the same parameter tensors)
rather than megatron's autograd-aware layers, whose per-module Python work dominated
the scoring time of small models (tiny GRPO reference pass: 0.011 -> 0.005 s).
Micro-batches flow stage to stage as each stage finishes them.
"""
from __future__ import annotations

import functools

import torch

from realign.data.packing import Pack, inference_packs
from realign.runtime.engines.base import (
    Batch,
    check_batch,
    from_last_stage,
    gather_dp,
    local_batch,
    split,
)
from realign.runtime.engines.decoder import StageDecoder, gather_vocab, run_stage
from realign.runtime.engines.ep_lockstep import announce_forward, drain
from realign.runtime.engines.packed_attention import kernel_for
from realign.runtime.model import ModelShard
from realign.runtime.router_replay import ROUTED_EXPERTS, replaying_batch
from realign.runtime.vocab_parallel import token_logprobs


def head_outputs(shard: ModelShard, output: torch.Tensor, mb: Batch) -> torch.Tensor:
    """The model's last-stage output for a micro-batch -> log-probs [b, s-1] (LM head;
    entry t is log p(tokens[t+1] | tokens[:t+1])) or values [b, s] (value head), zero
    past each sequence's length. Differentiable."""
    tokens, lengths = mb["tokens"], mb["lengths"]
    s = tokens.shape[1]
    if shard.head == "value":
        values = output.squeeze(-1).float()
        valid = torch.arange(s, device=tokens.device) < lengths.unsqueeze(1)
        return values * valid
    lp = token_logprobs(output[:, :-1], tokens[:, 1:], shard.groups.pgs.tp,
                        shard.spec.vocab_size)
    valid = torch.arange(1, s, device=tokens.device) < lengths.unsqueeze(1)
    return lp * valid


def packed_head_outputs(shard: ModelShard, output: torch.Tensor, pack: Pack, cols: int
                        ) -> torch.Tensor:
    """:func:`head_outputs` of a packed forward: the last stage's output at the pack's
    positions [bins, width, .] -> [rows of the pack, cols] in the padded layout (rows in
    ``pack.rows`` order), equal to what the padded forward gives. A log-prob's target
    is the next packed token (the next token of the same row wherever it is kept).
    Differentiable."""
    if shard.head == "value":
        return pack.unpack(output.squeeze(-1).float(), cols)
    targets = torch.roll(pack.tokens, -1, dims=1)
    lp = token_logprobs(output, targets, shard.groups.pgs.tp, shard.spec.vocab_size)
    return pack.unpack(lp, cols, shift=1)


class InferenceEngine:
    """``inference(batch)`` for one replica; every rank of the replica calls it with the
    same whole batch and gets the whole result. ``packing``: the rows run packed
    (:func:`realign.data.packing.inference_packs`): into bins of at most the plan's
    ``token_budget`` tokens, as many as that takes (data-parallel ranks may run
    different counts: they meet only at the final gather, of equal row counts), or
    without a budget at most ``micro_batches`` packs per data-parallel rank."""

    def __init__(self, shard: ModelShard, micro_batches: int = 1, packing: bool = False,
                 token_budget: int | None = None):
        if token_budget is not None and not packing:
            raise ValueError("a token budget packs rows: it needs packing=True")
        self.shard = shard
        self.micro_batches = micro_batches
        self.packing = packing
        self.token_budget = token_budget

    def inference(self, batch: Batch) -> dict[str, torch.Tensor]:
        """LM head: ``{"logprobs": [b, s-1]}``. Value head: ``{"values": [b, s],
        "scores": [b]}`` (the score is the value at each sequence's last token). A batch
        holding ``routed_experts`` (:data:`~realign.runtime.router_replay.ROUTED_EXPERTS`)
        is scored with those experts forced (rollout routing replay)."""
        b, s = batch["tokens"].shape
        shape = (b // self.shard.groups.layout.dp, s - (self.shard.head == "lm"))
        if self.packing:
            out = self._run_packed(batch, shape)
        else:
            out = self._run(batch, lambda output, mb: head_outputs(self.shard, output, mb),
                            shape)
        if self.shard.head == "value":
            lengths = batch["lengths"].to(out.device)
            scores = out.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
            return {"values": out, "scores": scores}
        return {"logprobs": out}

    def logits(self, batch: Batch) -> torch.Tensor:
        """Full-vocabulary logits [b, s, vocab_size] (LM head; memory-hungry: for
        checks and small batches)."""
        assert self.shard.head == "lm"
        b, s = batch["tokens"].shape
        v = self.shard.spec.vocab_size
        tp_group = self.shard.groups.pgs.tp if self.shard.groups.layout.tp > 1 else None
        return self._run(batch, lambda output, mb: gather_vocab(output, tp_group)[..., :v],
                         (b // self.shard.groups.layout.dp, s, v))

    def _run(self, batch: Batch, fn, local_shape) -> torch.Tensor:
        shard = self.shard
        check_batch(batch, shard, self.micro_batches)
        micro = split(local_batch(batch, shard), self.micro_batches)
        results = []
        dec = StageDecoder(shard, max_len=batch["tokens"].shape[1])
        # inference mode (cheaper small ops than no_grad); what leaves it is made
        # outside by the concatenation below, an ordinary tensor
        with torch.inference_mode():
            for mb in micro:        # stages pass micro-batches on as they finish them
                with replaying_batch(shard, mb.get(ROUTED_EXPERTS)):
                    out = run_stage(shard, dec.score, mb["tokens"])
                if out is not None:
                    results.append(fn(out, mb).float())
        mine = torch.cat(results) if shard.groups.is_last_stage else None
        return gather_dp(shard, from_last_stage(shard, mine, local_shape, torch.float32)).cpu()


    def _run_packed(self, batch: Batch, local_shape) -> torch.Tensor:
        """:meth:`_run` of the head outputs over packs instead of padded micro-batches;
        each pack's rows are written back to their places in the padded layout."""
        shard = self.shard
        # a budget's bins are not a split of the rows (micro_batches is their expected count)
        check_batch(batch, shard, self.micro_batches if self.token_budget is None else 1)
        local = local_batch(batch, shard)
        packs = inference_packs(local["tokens"], local["lengths"], self.micro_batches,
                                kernel_for(shard.device.kind), self.token_budget)
        dec = StageDecoder(shard, max_len=batch["tokens"].shape[1])
        results = []
        with torch.inference_mode():
            for pack in packs:
                # data-parallel ranks may run different pack counts: with expert
                # parallelism the EP group keeps in step (ep_lockstep; nothing at EP 1)
                announce_forward(shard)
                with replaying_batch(shard, local.get(ROUTED_EXPERTS), pack):
                    out = run_stage(shard, functools.partial(dec.score, pack=pack),
                                    pack.tokens)
                if out is not None:
                    results.append(packed_head_outputs(shard, out, pack, local_shape[1]))
            drain(shard)
        mine = None
        if shard.groups.is_last_stage:
            mine = torch.zeros(local_shape, dtype=torch.float32, device=shard.device.device)
            for pack, res in zip(packs, results):
                mine[pack.rows] = res
        return gather_dp(shard, from_last_stage(shard, mine, local_shape, torch.float32)).cpu()
