"""LoRA cases run inside the gloo world: realign's adapters against PEFT's on the same
base, initialisation and batch; adapter-only reallocation; PEFT files in and out."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from cases_model import replica, sample_batch
from cases_train import sft_loss
from tiny_hf import hf_model

from planner.specs.lora import COLUMN, HF_TARGETS, LoraSpec
from realign.runtime.engines.base import position_ids
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.engines.inference import InferenceEngine, head_outputs
from realign.runtime.lora import adapted, attach_lora
from realign.runtime.lora_peft import (
    b_from_hf,
    check_peft_adapter,
    load_peft_adapter,
)

LORA = LoraSpec(rank=4, alpha=8)
HF_MODULES = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp",
              "linear_fc2": "mlp"}


def hf_module(layer, name: str):
    """The Hugging Face (PEFT-wrapped) projection ``name`` of a decoder layer."""
    return getattr(getattr(layer, HF_MODULES[HF_TARGETS[name]]), name)


def peft_reference(path, lora: LoraSpec, seed: int = 0, std: float = 0.3):
    """A PEFT LoRA model on the HF checkpoint with random A and B, in eval mode (no
    dropout): every projection its own A, as PEFT makes them (the fused layers' parts
    share A only for ``lora.shared_a``)."""
    from peft import LoraConfig, get_peft_model

    model = hf_model(path)
    peft = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha or lora.rank,
                                            lora_dropout=0.0,
                                            target_modules=list(lora.target_modules)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in peft.base_model.model.model.layers:
            for target in lora.targets:
                shared = None
                for n in lora.parts(target):
                    m = hf_module(layer, n)
                    a = torch.randn(m.lora_A["default"].weight.shape, generator=g) * std
                    if lora.shared_a:
                        shared = a if shared is None else shared
                        a = shared
                    m.lora_A["default"].weight.copy_(a)
                    w = m.lora_B["default"].weight
                    w.copy_(torch.randn(w.shape, generator=g) * std)
    return peft.eval()


def peft_grads(peft, batch, lora: LoraSpec = LORA):
    """(loss, {(layer, hf module, factor): grad}) of the SFT loss on ``batch``."""
    peft.zero_grad()
    logits = peft(batch["tokens"]).logits
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(
        -1, batch["tokens"][:, 1:, None])[..., 0]
    s = batch["tokens"].shape[1]
    lp = lp * (torch.arange(1, s) < batch["lengths"][:, None])
    loss, _ = sft_loss(lp, batch)
    loss.backward()
    grads = {}
    for i, layer in enumerate(peft.base_model.model.model.layers):
        for n in lora.target_modules:
            m = hf_module(layer, n)
            grads[(i, n, "A")] = m.lora_A["default"].weight.grad.clone()
            grads[(i, n, "B")] = m.lora_B["default"].weight.grad.clone()
    return float(loss.detach()), grads


def lora_replica(ctx, path, tp, pp=1, seed=0, lora=LORA, std=0.3):
    """A fresh replica with realign's adapters loaded from the PEFT reference's files
    (written and checked here, so the way in is tested too); None off-mesh."""
    shard = replica(ctx, path, "lm", tp, pp, 1, fresh=True)
    if shard is None:
        return None, None
    ref = peft_reference(path, lora, seed, std)
    folder = Path(tempfile.mkdtemp(prefix="peft-ref-"))
    ref.save_pretrained(str(folder))
    check_peft_adapter(folder, shard.spec, "lm", lora, "lora.actor.init_from")
    attach_lora(shard, lora, seed)
    load_peft_adapter(shard, folder)
    return shard, ref


def local_slice(t, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's slice of a full logical tensor (as the runtime holds it)."""
    if t.shard_dim is None:
        return full
    return torch.cat([full.narrow(t.shard_dim, a, b - a)
                      for a, b in t.shard_ranges(tp_rank, tp)], t.shard_dim)


def peft_parity(ctx, path, tp, forward, lora=LORA):
    """Max |loss - PEFT's|, max relative |adapter grad - PEFT's| (fused A: the parts'
    gradients stacked, or summed for ``shared_a``; B: the parts' rows in megatron's
    order, this rank's slice), and whether the base has no gradient, with realign's
    plain or megatron forward."""
    shard, ref = lora_replica(ctx, path, tp, lora=lora)
    if shard is None:
        return None
    batch = sample_batch(n=4, s=12)
    ref_loss, ref_g = peft_grads(ref, batch, lora)
    tokens = batch["tokens"]
    shard.module.zero_grad()
    recompute = forward.endswith("+recompute")
    if forward.startswith("plain"):
        out = StageDecoder(shard, max_len=tokens.shape[1], recompute=recompute).score(tokens)
    else:
        if recompute:       # as TrainEngine sets it: every layer again in the backward
            cfg = shard.module.config
            cfg.recompute_granularity, cfg.recompute_method = "full", "uniform"
            cfg.recompute_num_layers = 1
        out = shard.module(tokens, position_ids(tokens), None)
    loss, _ = sft_loss(head_outputs(shard, out, batch), batch)
    loss.backward()
    g, spec = shard.groups, shard.spec
    worst = 0.0
    for i, layer in enumerate(shard.module.decoder.layers):
        tensors = {t.name.rsplit(".", 2)[-2] + t.name[-1]: t for t in lora.layer_tensors(spec, i)}
        for target, mod in adapted(layer).items():
            names = lora.parts(target)
            parts_a = [ref_g[(i, n, "A")] for n in names]
            want_a = sum(parts_a) if lora.shared_a else torch.cat(parts_a)
            want_b = b_from_hf(spec, target, [ref_g[(i, n, "B")] for n in names])
            want_a = local_slice(tensors[target + "A"], want_a, g.tp_rank, tp)
            want_b = local_slice(tensors[target + "B"], want_b, g.tp_rank, tp)
            assert target in COLUMN or len(names) == 1
            for got, want in ((mod.lora_A.grad, want_a), (mod.lora_B.grad, want_b)):
                worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    frozen = all(p.grad is None for n, p in shard.module.named_parameters()
                 if "lora_" not in n)
    return abs(float(loss) - ref_loss), worst, frozen


def peft_file_logits(ctx, path, tp, targets, shared_a=False):
    """An adapter made and saved by PEFT (its own A per projection), loaded through
    ``init_from``'s check and loader: (max |logits - PEFT's merged model's|, max
    |logits - the base's|, trained parameters of realign's replica, PEFT's trainable
    parameters), on every rank of the replica. Logit differences are relative to the
    largest |logit| (about 10 on these tiny random bases): in fp32, PEFT's own merged and
    unmerged models differ by about 5e-6 of it."""
    from realign.runtime.lora import trained_params

    lora = LoraSpec(rank=4, alpha=8, target_modules=targets, shared_a=shared_a)
    shard, ref = lora_replica(ctx, path, tp, lora=lora, seed=11, std=0.1)
    if shard is None:
        return None
    batch = sample_batch()
    ours = InferenceEngine(shard).logits(batch)
    valid = torch.arange(batch["tokens"].shape[1]) < batch["lengths"][:, None]
    n_peft = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    with torch.no_grad():
        with ref.disable_adapter():
            base = ref(batch["tokens"]).logits
        merged = ref.merge_and_unload()(batch["tokens"]).logits
    n_ours = sum(p.numel() for p in trained_params(shard).values())
    if tp > 1:                                  # the TP ranks' shares of the adapters
        import torch.distributed as dist
        split = sum(p.numel() for n, p in trained_params(shard).items()
                    if getattr(p, "tensor_model_parallel", False))
        t = torch.tensor([split], dtype=torch.float64)
        dist.all_reduce(t, group=shard.groups.pgs.tp)
        n_ours = n_ours - split + int(t.item())
    top = float(merged.abs()[valid].max())
    return (float((ours - merged).abs()[valid].max()) / top,
            float((ours - base).abs()[valid].max()), n_ours, n_peft)


def randomize_adapters(shard, seed: int, std: float) -> None:
    """Fill the replica's adapters with random values drawn whole per logical tensor
    (so alike at every layout), this rank keeping its slice."""
    import zlib

    from realign.runtime.model import global_name

    g, spec, lora = shard.groups, shard.spec, shard.lora
    tensors = {}
    for layer in range(spec.n_layers):
        tensors.update({t.name: t for t in lora.layer_tensors(spec, layer)})
    with torch.no_grad():
        for n, p in shard.module.named_parameters():
            name = global_name(n, spec, g.layout.pp, g.pp_rank)
            if name in tensors:
                t = tensors[name]
                gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
                full = torch.randn(t.shape, generator=gen) * std
                p.copy_(local_slice(t, full, g.tp_rank, g.layout.tp))


def export_logits(ctx, path, tp, targets, shared_a=False):
    """realign's adapters (random) written by ``save_peft_adapter`` and loaded by PEFT
    on the base: max |PEFT's logits - realign's| relative to the largest |logit| on the
    replica's first rank (None on the others), the projections the file adapts and those
    its config names."""
    import torch.distributed as dist
    from peft import PeftModel

    from realign.runtime.lora_peft import adapted_modules, read_peft_adapter, save_peft_adapter

    lora = LoraSpec(rank=4, alpha=8, target_modules=targets, shared_a=shared_a)
    shard = replica(ctx, path, "lm", tp, 1, 1, fresh=True)
    if shard is None:
        return None
    attach_lora(shard, lora, seed=5)
    randomize_adapters(shard, 5, std=0.1)
    batch = sample_batch()
    ours = InferenceEngine(shard).logits(batch)
    g = shard.groups
    box = [tempfile.mkdtemp(prefix="realign-export-") if g.tp_rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(g.model_group, 0),
                               group=g.model_group)
    save_peft_adapter(shard, box[0], str(path))
    if g.tp_rank != 0:
        return None
    peft = PeftModel.from_pretrained(hf_model(path), box[0]).eval()
    with torch.no_grad():
        theirs = peft(batch["tokens"]).logits
    valid = torch.arange(batch["tokens"].shape[1]) < batch["lengths"][:, None]
    cfg, tensors = read_peft_adapter(box[0])
    top = float(theirs.abs()[valid].max())
    return (float((ours - theirs).abs()[valid].max()) / top, sorted(adapted_modules(tensors)),
            sorted(cfg["target_modules"]))


def logits_with_adapters(ctx, path, tp, pp):
    """(max |log-probs - PEFT's|, max |log-probs - the base's without adapters|) of the
    scoring forward at this layout."""
    shard, ref = lora_replica(ctx, path, tp, pp)
    if shard is None:
        return None
    batch = sample_batch()
    ours = InferenceEngine(shard).inference(batch)["logprobs"]
    valid = torch.arange(1, batch["tokens"].shape[1]) < batch["lengths"][:, None]

    def logprobs(model):
        with torch.no_grad():
            logits = model(batch["tokens"]).logits
        return torch.log_softmax(logits, -1)[:, :-1].gather(
            -1, batch["tokens"][:, 1:, None])[..., 0] * valid
    with ref.disable_adapter():
        base = logprobs(ref)
    return float((ours - logprobs(ref)).abs().max()), float((ours - base).abs().max())


def dropout_grads(ctx, path, tp, recompute, dropout=0.3):
    """(loss, full adapter gradients by name) of one SFT forward and backward with LoRA
    dropout, the default generator seeded as a train call seeds it; None off rank 0."""
    from planner.specs.lora import adapter_stage_tensors
    from realign.runtime.hf_checkpoint import gather_full
    from realign.runtime.lora import seed_dropout
    from realign.runtime.model import global_name

    lora = LoraSpec(rank=4, alpha=8, dropout=dropout)
    shard, _ref = lora_replica(ctx, path, tp, lora=lora)
    if shard is None:
        return None
    batch = sample_batch(n=4, s=12)
    seed_dropout(shard, 0, 7, "actor")
    out = StageDecoder(shard, max_len=12, recompute=recompute).score(batch["tokens"])
    loss, _ = sft_loss(head_outputs(shard, out, batch), batch)
    loss.backward()
    g = shard.groups
    tensors = {t.name: t for t in adapter_stage_tensors(shard.spec, lora, 1, 0)}
    grads = {}
    for n, p in shard.module.named_parameters():
        name = global_name(n, shard.spec, 1, 0)
        if name in tensors:
            grads[name] = gather_full(tensors[name], p.grad, g.pgs.tp, tp)
    return (float(loss.detach()), grads) if g.tp_rank == 0 else None


def lora_train(ctx, path, head, tp, pp, dp, micro, steps, forward="plain"):
    """Train fresh rank-4 adapters (and a value head) with realign's engine: per-step
    metrics and the final outputs, at any layout (the adapters start alike at every one)."""
    from cases_train import CLIP, EPS, LR, value_loss

    from realign.runtime.engines.train import TrainConfig, TrainEngine

    shard = replica(ctx, path, head, tp, pp, dp, fresh=True)
    if shard is None:
        return None
    attach_lora(shard, LORA, seed=3)
    batch = sample_batch(n=8, s=10)
    batch["target"] = torch.linspace(-1, 1, 8)
    engine = TrainEngine(shard, TrainConfig(lr=LR, clip_grad=CLIP, adam_eps=EPS,
                                            distributed_optimizer=dp > 1, forward=forward,
                                            packing=forward != "megatron"),
                         micro_batches=micro)
    trained = sum(p.numel() for p in shard.module.parameters() if p.requires_grad)
    loss = sft_loss if head == "lm" else value_loss
    history = [engine.train_step(batch, loss) for _ in range(steps)]
    out = InferenceEngine(shard).inference(batch)
    return history, out["logprobs" if head == "lm" else "values"], trained
