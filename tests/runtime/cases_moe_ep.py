"""Cases of expert parallelism (EP) inside the gloo world: a Qwen3-MoE replica whose
experts are spread over EP groups carved out of its data-parallel ranks, its logits
against transformers' on each data-parallel rank's own batch, and what each rank holds."""
from __future__ import annotations

import torch
from cases_model import sample_batch
from tiny_hf import hf_model

from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from realign.runtime.device import init_device
from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.groups import build_replica_groups
from realign.runtime.hf_checkpoint import HFReader, check_checkpoint, load_hf_weights, spec_from_hf
from realign.runtime.model import build_model, logical_shards


def replica_ep(ctx, path, tp, dp, ep, pp=1):
    """A replica at tp x dp x pp with experts over EP groups of ``ep``, loaded from
    ``path`` (each rank reading its own stage's experts only); None off-mesh."""
    key = ("replica_ep", str(path), tp, dp, ep, pp)
    if key not in ctx.store:
        spec = spec_from_hf(path)
        reader = HFReader(path)
        check_checkpoint(reader, spec, "lm")
        groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=tp * dp * pp),
                                      Layout(tp=tp, pp=pp, dp=dp, ep=ep))
        shard = None
        if groups.member:
            shard = build_model(spec, "lm", groups, init_device("cpu", dtype="fp32"),
                                init_weights=False)
            load_hf_weights(shard, path, reader)
        ctx.store[key] = shard
    return ctx.store[key]


def logits_parity(ctx, path, tp, dp, ep, n, pp=1):
    """(max |logits - transformers'|, max |log-probs - transformers'|, the experts this
    rank holds in its stage's first sparse layer (none: a stage of dense layers only), its
    EP rank) of a batch of ``n`` rows (each data-parallel rank scores its own ``n / dp``
    of them, exchanging tokens with the other ranks of its EP group)."""
    shard = replica_ep(ctx, path, tp, dp, ep, pp)
    if shard is None:
        return None
    g = shard.groups
    batch = sample_batch(n=n, s=12, vocab=shard.spec.vocab_size, seed=n)
    eng = InferenceEngine(shard)
    ours = eng.logits(batch)
    lp = eng.inference(batch)["logprobs"]
    with torch.no_grad():
        ref = hf_model(path)(batch["tokens"]).logits
    valid = torch.arange(batch["tokens"].shape[1]) < batch["lengths"][:, None]
    ref_lp = torch.log_softmax(ref, -1)[:, :-1].gather(-1, batch["tokens"][:, 1:, None])[..., 0]
    lp_valid = torch.arange(1, batch["tokens"].shape[1]) < batch["lengths"][:, None]
    held = []
    for layer in shard.module.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            held = sorted(int(e) for e in experts.local_experts)
            break
    return (float((ours - ref).abs()[valid].max()),
            float((lp - ref_lp * lp_valid).abs().max()), held, g.ep_rank)


def held_tensors(ctx, path, tp, dp, ep):
    """The logical expert tensors this rank holds (names) and the largest difference of
    any of its tensors from its slice of the checkpoint."""
    from planner.specs.param_layout import stage_tensors
    from realign.runtime.hf_checkpoint import read_shard

    shard = replica_ep(ctx, path, tp, dp, ep)
    if shard is None:
        return None
    g = shard.groups
    got = logical_shards(shard, g.layout, g.pp_rank)
    want = {t.name: t for t in stage_tensors(shard.spec, "lm", 1, 0)}
    reader = HFReader(path)
    worst = max(float((got[n] - read_shard(reader, shard.spec, want[n], g.tp_rank, tp))
                      .abs().max()) for n in got)
    return sorted(n for n in got if ".local_experts." in n), worst


def save_from_ep(ctx, path, out, tp, dp, ep):
    """Write the EP replica as an HF checkpoint to ``out``; the names it holds."""
    import json
    from pathlib import Path

    from realign.runtime.hf_checkpoint import read_hf_config, save_hf_checkpoint

    shard = replica_ep(ctx, path, tp, dp, ep)
    if shard is None:
        return None
    save_hf_checkpoint(shard, out, read_hf_config(path))
    index = json.loads(next(Path(out).glob("*.index.json")).read_text())
    return sorted(index["weight_map"])


def packed_scores(ctx, path, dp, ep, budget):
    """(log-probs of 8 rows scored packed into bins of at most ``budget`` tokens, this
    rank's bin count): data-parallel rank 0's rows are long and rank 1's short, so the
    ranks run different numbers of forwards."""
    from realign.data.packing import inference_packs
    from realign.runtime.engines.packed_attention import kernel_for

    shard = replica_ep(ctx, path, 1, dp, ep)
    if shard is None:
        return None
    batch = sample_batch(n=8, s=12, vocab=shard.spec.vocab_size, seed=2)
    batch["lengths"] = torch.tensor([12, 11, 12, 10, 2, 3, 2, 2])
    lp = InferenceEngine(shard, packing=True, token_budget=budget).inference(batch)["logprobs"]
    per = 8 // dp
    mine = slice(shard.groups.dp_rank * per, (shard.groups.dp_rank + 1) * per)
    bins = len(inference_packs(batch["tokens"][mine], batch["lengths"][mine], 1,
                               kernel_for("cpu"), budget))
    return lp, bins
