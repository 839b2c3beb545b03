"""Cases run inside the gloo world (see realign.runtime.local_world): model build, HF loading,
logits parity, logical shards."""
from __future__ import annotations

import torch
from tiny_hf import hf_model

from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.param_layout import stage_tensors
from realign.runtime.device import init_device
from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.groups import build_replica_groups
from realign.runtime.hf_checkpoint import HFReader, check_checkpoint, load_hf_weights, spec_from_hf
from realign.runtime.model import build_model, logical_shards


def replica(ctx, path, head, tp, pp, dp, first=0, fresh=False, dtype="fp32"):
    """Build (or fetch from the store) a replica loaded from ``path``; None off-mesh.
    ``fresh`` builds a new one (for cases that change the weights)."""
    key = ("replica", str(path), head, tp, pp, dp, first, dtype)
    if fresh:                       # never cached: the caller changes its weights
        key = key + (len(ctx.store),)
    if key not in ctx.store:
        dev = init_device("cpu", dtype=dtype)
        spec = spec_from_hf(path)
        reader = HFReader(path)
        check_checkpoint(reader, spec, head)
        mesh, layout = DeviceMesh(first_gpu=first, n_gpus=tp * pp * dp), Layout(tp=tp, pp=pp, dp=dp)
        groups = build_replica_groups(spec, mesh, layout)
        shard = None
        if groups.member:
            shard = build_model(spec, head, groups, dev, init_weights=False)
            load_hf_weights(shard, path, reader)
        ctx.store[key] = shard
    return ctx.store[key]


def sample_batch(n=4, s=12, vocab=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, s), generator=g)
    lengths = torch.tensor([s, s - 3, s - 5, 2] * (n // 4))[:n]
    return {"tokens": tokens, "lengths": lengths}


def logits_parity(ctx, path, tp, pp, dp):
    """Max |logits - transformers' logits| over valid positions, on every rank."""
    shard = replica(ctx, path, "lm", tp, pp, dp)
    if shard is None:
        return None
    batch = sample_batch()
    ours = InferenceEngine(shard).logits(batch)
    ref = hf_model(path)(batch["tokens"]).logits
    valid = torch.arange(batch["tokens"].shape[1]) < batch["lengths"][:, None]
    lp = InferenceEngine(shard).inference(batch)["logprobs"]
    ref_lp = torch.log_softmax(ref, -1)[:, :-1].gather(-1, batch["tokens"][:, 1:, None])[..., 0]
    lp_valid = torch.arange(1, batch["tokens"].shape[1]) < batch["lengths"][:, None]
    return (float((ours - ref).abs()[valid].max()),
            float((lp - ref_lp * lp_valid).abs().max()))


def scoring_matches_megatron_forward(ctx, path, head, tp, pp, micro_batches):
    """Max |scoring forward - megatron GPTModel forward| of the head's output (log-probs
    or values), the latter run through megatron's own pipeline schedule."""
    from realign.runtime.engines.base import (
        from_last_stage,
        gather_dp,
        local_batch,
        position_ids,
        run_schedule,
        split,
    )
    from realign.runtime.engines.inference import head_outputs

    shard = replica(ctx, path, head, tp, pp, 1)
    if shard is None:
        return None
    batch = sample_batch(n=8)
    ours = InferenceEngine(shard, micro_batches=micro_batches).inference(batch)
    ours = ours["logprobs" if head == "lm" else "values"]

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


def reward_parity(ctx, path, tp, pp, dp):
    """Scores of a value-head replica vs transformers' sequence classifier, and the
    per-token values vs its score head on every position."""
    shard = replica(ctx, path, "value", tp, pp, dp)
    if shard is None:
        return None
    batch = sample_batch()
    out = InferenceEngine(shard).inference(batch)
    ref = hf_model(path)
    with torch.no_grad():
        values = ref.score(ref.model(batch["tokens"]).last_hidden_state)[..., 0]
    valid = torch.arange(batch["tokens"].shape[1]) < batch["lengths"][:, None]
    # transformers scores the last non-pad token: give it exactly the valid tokens
    scores = torch.stack([ref(batch["tokens"][i:i + 1, :n]).logits[0, 0]
                          for i, n in enumerate(batch["lengths"].tolist())]).detach()
    return (float((out["values"] - values * valid).abs().max()),
            float((out["scores"] - scores).abs().max()))


def logical_shards_check(ctx, path, head, tp, pp, dp):
    """logical_shards: names are the planner's stage tensors, each value is this rank's
    slice of the HF weights (read independently), and writing into it changes the
    model's output."""
    shard = replica(ctx, path, head, tp, pp, dp, fresh=True)
    if shard is None:
        return None
    g = shard.groups
    got = logical_shards(shard, g.layout, g.pp_rank)
    want = {t.name: t for t in stage_tensors(shard.spec, head, pp, g.pp_rank)}
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    from realign.runtime.hf_checkpoint import read_shard
    reader = HFReader(path)
    worst = 0.0
    for name, tensor in got.items():
        ref = read_shard(reader, shard.spec, want[name], g.tp_rank, tp)
        assert tensor.shape == ref.shape, name
        worst = max(worst, float((tensor - ref).abs().max()))
    batch = sample_batch()
    eng = InferenceEngine(shard)
    key = "logprobs" if head == "lm" else "values"
    before = eng.inference(batch)[key]
    name = next(n for n in got if n.endswith("mlp.linear_fc2.weight"))
    got[name].zero_()                              # a view: the model must change
    after = eng.inference(batch)[key]
    return worst, float((before - after).abs().max())


def save_roundtrip(ctx, src, dst, tp, pp, dp):
    """Save a replica in HF format; transformers loads it with identical weights."""
    from realign.runtime.hf_checkpoint import read_hf_config, save_hf_checkpoint
    shard = replica(ctx, src, "lm", tp, pp, dp)
    if shard is not None:
        save_hf_checkpoint(shard, dst, read_hf_config(src))
    torch.distributed.barrier()
    if ctx.rank != 0:
        return None
    a, b = hf_model(src).state_dict(), hf_model(dst).state_dict()
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    import os
    return max(float((a[k] - b[k]).abs().max()) for k in a), sorted(os.listdir(dst))


def bad_input(ctx, path, what):
    """Each rank must raise UserError before any collective; returns the message."""
    from realign.errors import UserError
    init_device("cpu")
    try:
        spec = spec_from_hf(path)
        if what == "mesh_too_big":
            build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=4), Layout(tp=2, dp=2))
        elif what == "heads":
            spec = spec.model_copy(update={"n_heads": 3, "n_kv_heads": 1, "head_dim": 16})
            build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=2), Layout(tp=2))
        elif what == "shapes":
            check_checkpoint(HFReader(path), spec, "lm")
        elif what == "value_head_missing":
            check_checkpoint(HFReader(path), spec, "value")
    except UserError as e:
        return str(e)
    return "no error"


def several_replicas(ctx, paths):
    """Three replicas with different layouts live in the same processes at once and
    give the same log-probs: TP2, TP1·DP2 and a TP1 replica on rank 1 only."""
    a = replica(ctx, paths["llama"], "lm", 2, 1, 1)
    b = replica(ctx, paths["llama"], "lm", 1, 1, 2)
    c = replica(ctx, paths["llama"], "lm", 1, 1, 1, first=1)
    batch = sample_batch()
    outs = [InferenceEngine(a).inference(batch)["logprobs"],
            InferenceEngine(b).inference(batch)["logprobs"]]
    if c is not None:
        outs.append(InferenceEngine(c).inference(batch)["logprobs"])
    return len(outs), max(float((o - outs[0]).abs().max()) for o in outs)


def groups_reused(ctx, path):
    """Build the groups of one layout twice: the second build makes no process group
    (the same objects come back)."""
    import torch.distributed as dist

    spec = spec_from_hf(path)
    made = lambda: len(dist.distributed_c10d._world.pg_map)  # noqa: E731
    mesh = DeviceMesh(first_gpu=0, n_gpus=2)
    first = build_replica_groups(spec, mesh, Layout(tp=2, pp=1, dp=1))
    before = made()
    again = build_replica_groups(spec, mesh, Layout(tp=2, pp=1, dp=1))
    return again.pgs.tp is first.pgs.tp and again.pgs.pp is first.pgs.pp, made() - before
