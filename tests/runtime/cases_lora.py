"""LoRA cases run inside the gloo world: realign's adapters against PEFT's on the same
base, initialisation and batch; adapter-only reallocation; PEFT files in and out."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from cases_model import replica, sample_batch
from cases_train import sft_loss
from tiny_hf import hf_model

from planner.specs.lora import COLUMN, HF_NAMES, LoraSpec
from realign.runtime.engines.base import position_ids
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.engines.inference import InferenceEngine, head_outputs
from realign.runtime.lora import adapted, attach_lora
from realign.runtime.lora_peft import (
    b_from_hf,
    base_tensor,
    check_peft_adapter,
    load_peft_adapter,
)

LORA = LoraSpec(rank=4, alpha=8)
HF_MODULES = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp",
              "linear_fc2": "mlp"}


def peft_reference(path, lora: LoraSpec, seed: int = 0):
    """A PEFT LoRA model on the HF checkpoint with random A and B (the fused layers'
    parts sharing A, as realign's adapters do), in eval mode (no dropout)."""
    from peft import LoraConfig, get_peft_model

    model = hf_model(path)
    targets = sorted(n for t in lora.target_modules for n in HF_NAMES[t])
    peft = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha or lora.rank,
                                            lora_dropout=0.0, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in peft.base_model.model.model.layers:
            for target in lora.target_modules:
                mods = [getattr(getattr(layer, HF_MODULES[target]), n) for n in HF_NAMES[target]]
                a = torch.randn(mods[0].lora_A["default"].weight.shape, generator=g) * 0.3
                for m in mods:
                    m.lora_A["default"].weight.copy_(a)
                    w = m.lora_B["default"].weight
                    w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    return peft.eval()


def peft_grads(peft, batch):
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
        for target in LORA.target_modules:
            for n in HF_NAMES[target]:
                m = getattr(getattr(layer, HF_MODULES[target]), n)
                grads[(i, n, "A")] = m.lora_A["default"].weight.grad.clone()
                grads[(i, n, "B")] = m.lora_B["default"].weight.grad.clone()
    return float(loss.detach()), grads


def lora_replica(ctx, path, tp, pp=1, seed=0, lora=LORA):
    """A fresh replica with realign's adapters loaded from the PEFT reference's files
    (written and checked here, so the way in is tested too); None off-mesh."""
    shard = replica(ctx, path, "lm", tp, pp, 1, fresh=True)
    if shard is None:
        return None, None
    ref = peft_reference(path, LORA, seed)
    folder = Path(tempfile.mkdtemp(prefix="peft-ref-"))
    ref.save_pretrained(str(folder))
    check_peft_adapter(folder, shard.spec, "lm", lora, "lora.actor.init_from")
    attach_lora(shard, lora, seed)
    load_peft_adapter(shard, folder)
    return shard, ref


def peft_parity(ctx, path, tp, forward):
    """Max |loss - PEFT's|, max relative |adapter grad - PEFT's| (fused A: the sum of the
    parts' gradients; B: the parts' rows in megatron's order, this rank's slice), and
    whether the base has no gradient, with realign's plain or megatron forward."""
    shard, ref = lora_replica(ctx, path, tp)
    if shard is None:
        return None
    batch = sample_batch(n=4, s=12)
    ref_loss, ref_g = peft_grads(ref, batch)
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
        for target, mod in adapted(layer).items():
            names = HF_NAMES[target]
            want_a = sum(ref_g[(i, n, "A")] for n in names)
            want_b = b_from_hf(spec, target, [ref_g[(i, n, "B")] for n in names])
            if target in COLUMN:
                t = base_tensor(spec, i, target)
                want_b = torch.cat([want_b[a:b] for a, b in t.shard_ranges(g.tp_rank, tp)])
            else:
                k = want_a.shape[1]
                want_a = want_a[:, g.tp_rank * k // tp:(g.tp_rank + 1) * k // tp]
            for got, want in ((mod.lora_A.grad, want_a), (mod.lora_B.grad, want_b)):
                worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    frozen = all(p.grad is None for n, p in shard.module.named_parameters()
                 if "lora_" not in n)
    return abs(float(loss) - ref_loss), worst, frozen


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
