"""Cases run inside the gloo world (see dist_harness): model build, HF loading,
logits parity, logical shards."""
from __future__ import annotations

import torch

from planner.layout import Layout
from planner.mesh import DeviceMesh
from planner.param_layout import stage_tensors
from realign.runtime.device import init_device
from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.groups import build_replica_groups
from realign.runtime.hf_checkpoint import HFReader, check_checkpoint, load_hf_weights, spec_from_hf
from realign.runtime.model import build_model, logical_shards
from tiny_hf import hf_model


def replica(ctx, path, head, tp, pp, dp, first=0, fresh=False):
    """Build (or fetch from the store) a replica loaded from ``path``; None off-mesh.
    ``fresh`` builds a new one (for cases that change the weights)."""
    key = ("replica", str(path), head, tp, pp, dp, first)
    if key not in ctx.store or fresh:
        dev = init_device("cpu")
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
