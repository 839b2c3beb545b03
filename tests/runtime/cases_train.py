"""Training cases run inside the gloo world: megatron train_step against a plain
PyTorch reference (transformers model + torch AdamW) on the same weights and data."""
from __future__ import annotations

import torch
from cases_model import replica, sample_batch
from tiny_hf import hf_model

from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.engines.train import TrainConfig, TrainEngine

# a large Adam epsilon keeps float noise in near-zero gradients from turning into
# full-size (lr) updates, so the two implementations stay comparable after a step
LR, CLIP, EPS = 1e-2, 0.5, 1e-4


def sft_loss(outputs, mb):
    """Mean negative log-likelihood of the valid next tokens."""
    s = mb["tokens"].shape[1]
    valid = (torch.arange(1, s) < mb["lengths"].unsqueeze(1)).float()
    n = valid.sum()
    return -(outputs * valid).sum() / n, {"tokens": n}


def value_loss(outputs, mb):
    """Regress every valid position's value onto the sequence's target."""
    s = mb["tokens"].shape[1]
    valid = (torch.arange(s) < mb["lengths"].unsqueeze(1)).float()
    err = (outputs - mb["target"].unsqueeze(1)) ** 2 * valid
    return err.sum() / valid.sum(), {}


def train(ctx, path, head, tp, pp, dp, micro, steps, distributed_optimizer=True,
          forward="auto", recompute=False):
    """Train a fresh replica; returns per-step metrics and the final outputs."""
    shard = replica(ctx, path, head, tp, pp, dp, fresh=True)
    if shard is None:
        return None
    batch = sample_batch(n=8, s=10)
    batch["target"] = torch.linspace(-1, 1, 8)
    engine = TrainEngine(shard, TrainConfig(lr=LR, clip_grad=CLIP, adam_eps=EPS,
                                            distributed_optimizer=distributed_optimizer,
                                            forward=forward,
                                            packing=forward != "megatron"),
                         micro_batches=micro,
                         recompute=recompute)
    assert engine.optimizer.optimizer.param_groups[0]["fused"], "CPU Adam runs fused"
    loss = sft_loss if head == "lm" else value_loss
    history = [engine.train_step(batch, loss) for _ in range(steps)]
    out = InferenceEngine(shard).inference(batch)
    return history, out["logprobs" if head == "lm" else "values"]


def offload_on_cpu(ctx, path):
    """The plan's optimizer offload on a cpu device: the error it stops with."""
    from realign.errors import UserError
    shard = replica(ctx, path, "lm", 1, 1, 2, fresh=True)
    try:
        TrainEngine(shard, TrainConfig(lr=LR, distributed_optimizer=True),
                    optimizer_offload=True)
    except UserError as e:
        return e.field, str(e)
    return None, "no error"


def train_local_metrics(ctx, path, tp, pp, dp):
    """One step with ``dp_mean=False``: (this rank's metrics, last stage?, dp rank)."""
    shard = replica(ctx, path, "lm", tp, pp, dp, fresh=True)
    batch = sample_batch(n=8, s=10)
    engine = TrainEngine(shard, TrainConfig(lr=LR, clip_grad=CLIP, adam_eps=EPS))
    metrics = engine.train_step(batch, sft_loss, dp_mean=False)
    g = shard.groups
    return metrics, g.is_last_stage, g.dp_rank


def reference(ctx, path, head, chunks, steps):
    """The same training in plain PyTorch: mean of ``chunks`` equal chunk losses."""
    if ctx.rank != 0:
        return None
    model = hf_model(path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    batch = sample_batch(n=8, s=10)
    batch["target"] = torch.linspace(-1, 1, 8)
    history = []

    def outputs(mb):
        if head == "lm":
            logits = model(mb["tokens"]).logits
            lp = logits[:, :-1].log_softmax(-1).gather(-1, mb["tokens"][:, 1:, None])[..., 0]
            s = mb["tokens"].shape[1]
            return lp * (torch.arange(1, s) < mb["lengths"][:, None])
        hidden = model.model(mb["tokens"]).last_hidden_state
        s = mb["tokens"].shape[1]
        return model.score(hidden)[..., 0] * (torch.arange(s) < mb["lengths"][:, None])

    fn = sft_loss if head == "lm" else value_loss
    for _ in range(steps):
        opt.zero_grad()
        parts = [{k: v.chunk(chunks)[i] for k, v in batch.items()} for i in range(chunks)]
        loss = sum(fn(outputs(mb), mb)[0] for mb in parts) / chunks
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        history.append({"loss": float(loss), "grad_norm": float(norm)})
    with torch.no_grad():
        return history, outputs(batch)


def nonfinite_gradient(ctx, path, tp, pp, dp, distributed_optimizer):
    """A loss whose gradient is NaN: every rank of the replica raises NonFiniteError
    before the optimizer step, and the parameters keep their values. Returns (raised on
    this rank, largest parameter change), or None off the replica."""
    from realign.errors import NonFiniteError

    shard = replica(ctx, path, "lm", tp, pp, dp, fresh=True)
    if shard is None:
        return None
    engine = TrainEngine(shard, TrainConfig(lr=LR, clip_grad=CLIP, adam_eps=EPS,
                                            distributed_optimizer=distributed_optimizer))
    before = [p.detach().clone() for p in shard.module.parameters()]

    def nan_loss(outputs, mb):
        return outputs.sum() * float("nan"), {}

    raised = False
    try:
        engine.train_step(sample_batch(n=4, s=10), nan_loss)
    except NonFiniteError as e:
        raised = "gradient norm is nan" in str(e)
    changed = max(float((p.detach() - b).abs().max())
                  for p, b in zip(shard.module.parameters(), before))
    return raised, changed


def bf16_resume(ctx, path, tp, pp, dp, zero1, steps=3):
    """bf16 training with megatron's mixed-precision optimizer (fp32 main weights):
    ``steps`` steps straight, against ``steps - 1`` steps, a checkpoint of the model and
    :func:`optimizer_state` loaded into a fresh replica and engine (built before the
    load, as a resumed worker builds them), then the last step. Returns (largest
    difference of the final weights, optimizer kinds), or None off the replica."""
    from realign.runtime.optimizer_state import load_optimizer_state, optimizer_state, torch_optimizers

    batches = [sample_batch(n=4, s=10, seed=k) for k in range(steps)]

    def engine_of(shard):
        return TrainEngine(shard, TrainConfig(lr=LR, clip_grad=CLIP, adam_eps=EPS,
                                              distributed_optimizer=zero1))

    # every rank builds the three replicas (making process groups is collective over
    # the world), members only go on
    straight, first, resumed = (replica(ctx, path, "lm", tp, pp, dp, fresh=True, dtype="bf16")
                                for _ in range(3))
    if straight is None:
        return None
    eng = engine_of(straight)
    for b in batches:
        eng.train_step(b, sft_loss)
    eng1 = engine_of(first)
    for b in batches[:-1]:
        eng1.train_step(b, sft_loss)
    saved = {"module": {k: v.clone() if torch.is_tensor(v) else v
                        for k, v in first.module.state_dict().items()},
             "optimizer": optimizer_state(eng1.optimizer)}
    eng2 = engine_of(resumed)
    resumed.module.load_state_dict(saved["module"])
    load_optimizer_state(eng2.optimizer, saved["optimizer"])
    eng2.train_step(batches[-1], sft_loss)
    diff = max(float((a.float() - b.float()).abs().max())
               for a, b in zip(straight.module.parameters(), resumed.module.parameters()))
    kinds = sorted({type(sub).__name__ for sub in eng2.optimizer.chained_optimizers})
    assert all(p.dtype == torch.bfloat16 for p in resumed.module.parameters())
    assert all(p.dtype == torch.float32 for o in torch_optimizers(eng2.optimizer)
               for g in o.param_groups for p in g["params"])      # fp32 main weights
    return diff, kinds


def state_offload(ctx, path, tp, pp, dp, zero1, dtype, steps=3):
    """The plan's training-state offload against the same training without it: after
    every step the gradient buffers and the optimizer's state are freed on the device
    (storage of zero bytes), and the weights, the losses and the optimizer state (read
    inside ``state_on_device``, as a checkpoint does) are bit-identical. Returns
    (largest weight difference, parked after every step, optimizer state equal, tensors
    parked, each step's metrics with and without), or None off the replica."""
    from realign.runtime.engines.train_state import optimizer_device_tensors
    from realign.runtime.optimizer_state import optimizer_state

    batches = [sample_batch(n=8, s=10, seed=k) for k in range(steps)]
    plain, parked = (replica(ctx, path, "lm", tp, pp, dp, fresh=True, dtype=dtype)
                     for _ in range(2))
    if plain is None:
        return None
    cfg = TrainConfig(lr=LR, clip_grad=CLIP, adam_eps=EPS, distributed_optimizer=zero1)
    eng, eng_off = TrainEngine(plain, cfg), TrainEngine(parked, cfg, state_offload=True)
    dev = parked.device.device
    freed, n_parked, metrics = True, 0, []
    for b in batches:
        want = eng.train_step(b, sft_loss)
        with eng_off.call():        # one train call of one step
            got = eng_off.train_step(b, sft_loss)
        metrics.append((got, want))
        state = optimizer_device_tensors(eng_off.optimizer, parked.module, dev)
        grads = [buf.grad_data for buf in eng_off.model.buffers]
        n_parked = len(state)
        freed &= all(t.untyped_storage().nbytes() == 0 for t in state + grads)
        freed &= all(p.untyped_storage().nbytes() > 0 for p in parked.module.parameters())
    want_state = optimizer_state(eng.optimizer)
    with eng_off.state_on_device():     # state_dict() holds the tensors, not copies
        got_state = optimizer_state(eng_off.optimizer)
        same = all(torch.equal(a, b) for a, b in zip(
            [p for ps in got_state["main_params"] for p in ps],
            [p for ps in want_state["main_params"] for p in ps]))
        for ga, gb in zip(got_state["torch"], want_state["torch"]):
            for k in ga["state"]:
                same &= all(torch.equal(torch.as_tensor(ga["state"][k][n]),
                                        torch.as_tensor(gb["state"][k][n]))
                            for n in ga["state"][k])
    freed &= all(t.untyped_storage().nbytes() == 0
                 for t in optimizer_device_tensors(eng_off.optimizer, parked.module, dev))
    diff = max(float((a.float() - b.float()).abs().max())
               for a, b in zip(plain.module.parameters(), parked.module.parameters()))
    return diff, freed, same, n_parked, metrics
