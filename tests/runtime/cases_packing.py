"""Packing cases run inside the gloo world: the same replica scores and trains one
batch padded and packed; returned are the differences of what each gives."""
from __future__ import annotations

import torch
from cases_model import replica

from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.engines.train import TrainConfig, TrainEngine

LR, CLIP, EPS = 1e-2, 0.5, 1e-4


def long_tail_batch(n=8, s=24, vocab=200, seed=3, lengths=(24, 5, 9, 3, 12, 2, 7, 17)):
    """Rows of very different lengths (mostly short, one at the width), the batch's
    shape of reasoning rollouts, with a per-token mask (a multi-turn action mask)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, s), generator=g)
    lengths = torch.tensor(lengths)[:n]
    action = (torch.rand(n, s - 1, generator=g) < 0.7).float()
    return {"tokens": tokens, "lengths": lengths, "action_mask": action,
            "target": torch.linspace(-1, 1, n)}


def masked_nll(outputs, mb):
    """Token mean over each row's valid next tokens under its action mask (observation
    tokens out of the loss), per micro-batch, as the RL losses normalise."""
    s = mb["tokens"].shape[1]
    valid = (torch.arange(1, s) < mb["lengths"].unsqueeze(1)).float() * mb["action_mask"]
    return -(outputs * valid).sum() / valid.sum().clamp(min=1), {"tokens": valid.sum()}


def value_loss(outputs, mb):
    s = mb["tokens"].shape[1]
    valid = (torch.arange(s) < mb["lengths"].unsqueeze(1)).float()
    err = (outputs - mb["target"].unsqueeze(1)) ** 2 * valid
    return err.sum() / valid.sum(), {}


def padded_vs_packed(ctx, path, head, tp, pp, dp, micro, budget=None, lengths=None):
    """For ``head`` at tp x pp x dp with ``micro`` micro-batches: max |scoring padded -
    packed| before training, then two train steps each from the same weights: the
    losses' and grad norms' largest relative difference, and max |scoring after - after|.
    ``budget``: packed scoring packs into bins of at most that many tokens (a plan's
    token budget); ``lengths``: the rows' lengths (their order sets each DP rank's)."""
    batch = long_tail_batch() if lengths is None else long_tail_batch(lengths=lengths)
    key = "logprobs" if head == "lm" else "values"
    loss = masked_nll if head == "lm" else value_loss
    # both replicas first: building one is collective over the world (its groups), so
    # every rank builds as many, members or not
    shards = [replica(ctx, path, head, tp, pp, dp, fresh=True) for _ in range(2)]
    if shards[0] is None:
        return None
    got = {}
    for packing, shard in zip((False, True), shards):
        scoring = InferenceEngine(shard, micro_batches=micro, packing=packing,
                                  token_budget=budget if packing else None)
        before = scoring.inference(batch)[key]
        engine = TrainEngine(shard, TrainConfig(lr=LR, clip_grad=CLIP, adam_eps=EPS,
                                                packing=packing), micro_batches=micro)
        steps = [engine.train_step(batch, loss) for _ in range(2)]
        got[packing] = (before, steps, scoring.inference(batch)[key])
    (b0, s0, a0), (b1, s1, a1) = got[False], got[True]
    # relative to the value's size past 1 (a value head's grad norm runs to hundreds)
    metric_diff = max(abs(x[k] - y[k]) / max(1.0, abs(x[k]))
                      for x, y in zip(s0, s1) for k in ("loss", "grad_norm"))
    return (float((b0 - b1).abs().max()), metric_diff, float((a0 - a1).abs().max()),
            float(b0.abs().max()), [x["loss"] for x in s1])
