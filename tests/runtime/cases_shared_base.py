"""Shared-base cases run inside the gloo world: a LoRA replica scored with its adapters
off against a replica of the same checkpoint loaded without LoRA (the separate reference
or reward model it stands for)."""
from __future__ import annotations

import torch
from cases_lora import LORA, randomize_adapters
from cases_model import replica, sample_batch

from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.lora import adapters_disabled, attach_lora


def adapters_off_scoring(ctx, path, head, tp, packing=False):
    """(adapters off == the separate copy bit for bit, per output; max |adapters on -
    the separate copy|; adapters on again after == before) on the replica's ranks, None
    off-mesh. A value model's trained head is moved off the checkpoint's first, so the
    kept checkpoint head is what makes it equal."""
    separate = replica(ctx, path, head, tp, 1, 1, fresh=True)
    shard = replica(ctx, path, head, tp, 1, 1, fresh=True)
    if shard is None:
        return None
    attach_lora(shard, LORA, seed=3)
    randomize_adapters(shard, 3, std=0.3)
    if head == "value" and shard.groups.is_last_stage:
        with torch.no_grad():
            shard.module.output_layer.weight.add_(0.25)     # as training moves it
    batch = sample_batch()

    def score(s):
        return InferenceEngine(s, micro_batches=2, packing=packing).inference(batch)
    want = score(separate)
    on = score(shard)
    with adapters_disabled(shard):
        off = score(shard)
    again = score(shard)
    return ({k: bool(torch.equal(off[k], want[k])) for k in want},
            max(float((on[k] - want[k]).abs().max()) for k in want),
            all(torch.equal(again[k], on[k]) for k in on))
