"""Token-budget training cases run inside the gloo world: one mini-batch of an
algorithm's prepared rollout trained as the plan's equal micro-batches of rows and as
token-budget bins; returned are the gradients each gives (before any update)."""
from __future__ import annotations

import torch
from cases_model import replica

from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.batch_shape import prompts_generated
from realign.algorithms import registry
from realign.algorithms.common import minibatch, pop_stats
from realign.runtime.engines.base import dp_rows
from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.engines.train import TrainConfig, TrainEngine

S, VOCAB = 24, 200
#: rows of very different lengths (a long tail), the prompts 3 to 6 tokens
LENGTHS = (24, 5, 9, 4, 12, 6, 7, 17, 21, 8, 11, 5, 16, 6, 24, 10)
PARAMS = {"grpo": {"samples_per_prompt": 2}, "rloo": {"samples_per_prompt": 2},
          "remax": {"samples_per_prompt": 2}, "gspo": {"samples_per_prompt": 2},
          "dr_grpo": {"samples_per_prompt": 2, "gen_len": S},
          "rejection_sampling": {"samples_per_prompt": 2},
          "online_dpo": {"samples_per_prompt": 2},
          "dapo": {"samples_per_prompt": 2, "prompts_per_step": 4, "gen_len": S,
                   "dropped_group_frac": 0.5},
          # PPO with its KL as a loss term (a second token mean)
          "ppo": {"kl_in_reward": False, "kl_coef": 0.1}}


def rollout(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` rows of a rollout with LENGTHS' lengths (cycled), random tokens, prompts
    of 3 to 6 tokens, a multi-turn action mask with holes, rewards that vary within
    every group of two."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([LENGTHS[i % len(LENGTHS)] for i in range(n)])
    prompts = torch.minimum(torch.randint(3, 7, (n,), generator=g), lengths - 1)
    return {"tokens": torch.randint(0, VOCAB, (n, S), generator=g), "lengths": lengths,
            "prompt_lengths": prompts,
            "action_mask": (torch.rand(n, S - 1, generator=g) < 0.8).float(),
            "rewards": torch.randn(n, generator=g),
            "greedy_rewards": torch.randn(n // 2, generator=g)}


def scored(batch, policy, value, seed: int) -> dict[str, torch.Tensor]:
    """``batch`` with log-probs, reference log-probs and values: the models' own where
    given (the reference a little off the policy, so ratios start near 1 and the clip
    does not zero the gradient), random where not (a field the trained loss does not
    read)."""
    g = torch.Generator().manual_seed(seed)
    n = batch["tokens"].shape[0]
    rows = {k: batch[k] for k in ("tokens", "lengths")}
    lp = (InferenceEngine(policy).inference(rows)["logprobs"] if policy is not None
          else -torch.rand(n, S - 1, generator=g))
    v = (InferenceEngine(value).inference(rows)["values"] if value is not None
         else torch.randn(n, S, generator=g))
    return {**batch, "logprobs": lp + 0.05 * torch.randn(lp.shape, generator=g),
            "ref_logprobs": lp + 0.05 * torch.randn(lp.shape, generator=g),
            "values": v + 0.1 * torch.randn(v.shape, generator=g)}


def prepared(name: str, policy, value) -> tuple[dict[str, torch.Tensor], object]:
    """The mini-batch the train call hands the engine, and the algorithm's config."""
    algo = registry.get(name)
    cfg = algo.config(**PARAMS.get(name, {}))
    n = 16
    if name == "dapo":
        n = 2 * prompts_generated(4, 0.5)
    raw = scored(rollout(n, seed=len(name)), policy, value, seed=7)
    if name != "remax":
        raw.pop("greedy_rewards")
    if name in ("dpo", "rm"):           # interleaved pairs, no rollout fields
        raw = {k: raw[k] for k in ("tokens", "lengths", "prompt_lengths", "action_mask",
                                   "ref_logprobs")}
    batch, _ = pop_stats(algo.prepare(raw, cfg))
    return minibatch(batch, 0, 1), cfg


def gradients(ctx, path, head, dp, name, role, settings):
    """For each (micro_batches, token_budget) of ``settings``: the flat gradient of one
    train step of ``role`` of algorithm ``name`` on one mini-batch, from the same
    weights (the step's update is undone), the step's loss metric and the row counts
    of this rank's micro-batches.
    None off the replica's mesh (and on every rank but the first when dp is 1)."""
    key = ("train_budget", str(path), head, dp)
    if key not in ctx.store:        # one replica and engine per layout for every case
        shard = replica(ctx, path, head, 1, 1, dp, fresh=True)
        ctx.store[key] = shard and (shard, TrainEngine(shard, TrainConfig(
            lr=1e-3, clip_grad=0.0, distributed_optimizer=False)))
    if ctx.store[key] is None:
        return None
    shard, engine = ctx.store[key]
    algo = registry.get(name)
    policy, value = (shard, None) if head == "lm" else (None, shard)
    batch, cfg = prepared(name, policy, value)
    graph = build_graph(name, BatchShape(samples_per_prompt=2), set(algo.spec.required_roles))
    group = graph.mfc(f"{role}.train").group_size           # 2: preference pairs
    engine.group_size = group
    loss = algo.loss_fn(role, cfg)
    saved = {k: v.clone() for k, v in shard.module.state_dict().items()
             if isinstance(v, torch.Tensor)}
    out = []
    for micro, budget in settings:
        engine.micro_batches, engine.token_budget = micro, budget
        metrics = engine.train_step(batch, loss)
        grad = torch.cat([p.main_grad.reshape(-1).clone() for p in engine.model.module.parameters()])
        mine = batch["lengths"][dp_rows(shard, len(batch["lengths"]))]
        out.append((grad, metrics["loss"], [len(rows) for rows in engine.micro_rows(mine)]))
        with torch.no_grad():
            shard.module.load_state_dict(saved, strict=False)
    return out
