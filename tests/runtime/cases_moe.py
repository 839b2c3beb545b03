"""Cases of a mixture of experts (Qwen3-MoE) run inside the gloo world: the plain
decoder's logits against transformers', megatron's forward against the decoder's, the
experts as the planner's logical tensors, and the HF checkpoint written back."""
from __future__ import annotations

import torch
from cases_model import replica, sample_batch
from tiny_hf import hf_model

from planner.specs.param_layout import stage_tensors
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.hf_checkpoint import HFReader, read_shard
from realign.runtime.model import logical_shards


def batch_of(shard, n=4, s=12, seed=0):
    return sample_batch(n=n, s=s, vocab=shard.spec.vocab_size, seed=seed)


def logits_parity(ctx, path, tp, pp):
    """(max |logits - transformers'|, max |log-probs - transformers'|) over valid
    positions, and whether the routing of every sparse layer equals transformers'
    (the experts each token of the batch is sent to)."""
    shard = replica(ctx, path, "lm", tp, pp, 1)
    if shard is None:
        return None
    batch = batch_of(shard)
    ours = InferenceEngine(shard).logits(batch)
    model = hf_model(path)
    with torch.no_grad():
        out = model(batch["tokens"], output_router_logits=True)
    ref = out.logits
    valid = torch.arange(batch["tokens"].shape[1]) < batch["lengths"][:, None]
    lp = InferenceEngine(shard).inference(batch)["logprobs"]
    ref_lp = torch.log_softmax(ref, -1)[:, :-1].gather(-1, batch["tokens"][:, 1:, None])[..., 0]
    lp_valid = torch.arange(1, batch["tokens"].shape[1]) < batch["lengths"][:, None]
    return (float((ours - ref).abs()[valid].max()),
            float((lp - ref_lp * lp_valid).abs().max()),
            len([r for r in out.router_logits if r is not None]))


def routing_matches(ctx, path, tp):
    """The experts the decoder's router picks for the first sparse layer's input equal
    transformers' (their top-k sets per token), at this TP."""
    from realign.runtime.moe import route

    shard = replica(ctx, path, "lm", tp, 1, 1)
    if shard is None:
        return None
    model = hf_model(path)
    layer = next(i for i in range(shard.spec.n_layers) if shard.spec.is_sparse(i))
    torch.manual_seed(1)
    y = torch.randn(40, shard.spec.hidden)
    ours = route(y, shard.module.decoder.layers[layer].mlp.router.weight,
                 shard.spec.moe.top_k, shard.spec.moe.norm_topk_prob)
    with torch.no_grad():
        _, w, idx = model.model.layers[layer].mlp.gate(y)
    same = bool((ours[1].sort(-1).values == idx.sort(-1).values).all())
    return same, float((ours[0].sort(-1).values - w.sort(-1).values).abs().max())


def megatron_matches_decoder(ctx, path, tp):
    """Max |megatron GPTModel forward - the decoder's scoring forward| of this rank's
    vocabulary-parallel logits (the MoE module is megatron's MLP there)."""
    from realign.runtime.engines.base import position_ids

    shard = replica(ctx, path, "lm", tp, 1, 1)
    if shard is None:
        return None
    tokens = batch_of(shard)["tokens"]
    with torch.no_grad():
        meg = shard.module(tokens, position_ids(tokens), None)
        ours = StageDecoder(shard, max_len=tokens.shape[1]).score(tokens)
    return float((meg - ours).abs().max())


def logical_shards_check(ctx, path, tp):
    """Each expert tensor and the router are the planner's logical tensors, holding this
    rank's slice of the HF weights; zeroing one expert's fc2 changes the output."""
    shard = replica(ctx, path, "lm", tp, 1, 1, fresh=True)
    if shard is None:
        return None
    g = shard.groups
    got = logical_shards(shard, g.layout, g.pp_rank)
    want = {t.name: t for t in stage_tensors(shard.spec, "lm", 1, 0)}
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    reader = HFReader(path)
    worst = max(float((got[n] - read_shard(reader, shard.spec, want[n], g.tp_rank, tp))
                      .abs().max()) for n in got)
    batch = batch_of(shard)
    eng = InferenceEngine(shard)
    before = eng.inference(batch)["logprobs"]
    for n in got:
        if ".mlp.experts.local_experts." in n and n.endswith("linear_fc2.weight"):
            got[n].zero_()
    after = eng.inference(batch)["logprobs"]
    return worst, float((before - after).abs().max())


def megatron_schedule_matches_decoder(ctx, path, tp, pp, micro_batches):
    """Max |the decoder's scoring log-probs - megatron GPTModel's through megatron's own
    pipeline schedule| (at PP > 1 each stage runs its own layers, sparse or dense)."""
    from realign.runtime.engines.base import (
        from_last_stage,
        gather_dp,
        local_batch,
        position_ids,
        run_schedule,
        split,
    )
    from realign.runtime.engines.inference import head_outputs

    shard = replica(ctx, path, "lm", tp, pp, 1)
    if shard is None:
        return None
    batch = batch_of(shard, n=8)
    ours = InferenceEngine(shard, micro_batches=micro_batches).inference(batch)["logprobs"]

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["tokens"], position_ids(mb["tokens"]), None)
        return out, lambda output, non_loss_data=True: head_outputs(shard, output, mb).float()

    micro = split(local_batch(batch, shard), micro_batches)
    with torch.no_grad():
        res = run_schedule(shard, shard.module, forward_step, micro, forward_only=True,
                           collect_non_loss_data=True)
    mine = torch.cat(res) if shard.groups.is_last_stage else None
    theirs = gather_dp(shard, from_last_stage(shard, mine, tuple(ours.shape), torch.float32))
    return float((ours - theirs).abs().max())
