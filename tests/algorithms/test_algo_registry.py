"""The algorithm table: names and trained roles agree with the planner's dataflow
graphs; lookups fail with useful errors; every algorithm prepares a synthetic rollout
and its loss functions give finite scalars whose gradient step lowers the loss."""
from __future__ import annotations

import math
import pickle

import pytest
import torch

from planner.graph.algorithms import ALGORITHMS as SPECS
from planner.graph.algorithms import BatchShape, build_graph
from realign.algorithms import registry
from realign.algorithms.common import minibatch, pop_stats
from realign.algorithms.registry import ALGORITHMS, Algorithm
from realign.config.experiment import AlgorithmSection
from realign.errors import UserError

pytestmark = pytest.mark.torch


def test_names_match_the_planner():
    assert list(ALGORITHMS) == list(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_trained_roles_match_the_graph(name):
    spec = SPECS[name]
    g = build_graph(name, BatchShape(samples_per_prompt=2), set(spec.required_roles))
    assert set(ALGORITHMS[name].trained_roles) == g.trainable_roles()
    assert ALGORITHMS[name].spec is spec


def test_lookup_errors():
    with pytest.raises(UserError, match="allowed: ppo, grpo"):
        registry.get("trpo")
    grpo = registry.get("grpo")
    with pytest.raises(UserError, match="trains no 'critic'"):
        grpo.critic_loss_fn(grpo.config(samples_per_prompt=2))
    with pytest.raises(TypeError, match="GRPOConfig"):
        grpo.actor_loss_fn(registry.get("ppo").config())


def section(name: str, params: dict, **shape) -> AlgorithmSection:
    """The experiment's ``algorithm`` section as the YAML loads it."""
    return AlgorithmSection.model_validate({"name": name, "params": params, **shape})


def test_params_are_typed_at_load_with_the_batch_shape_fields():
    shape = {"samples_per_prompt": 4, "ppo_epochs": 2, "ppo_minibatches": 8}
    cfg = section("ppo", {"kl_coef": 0.1}, **shape).params
    # epochs and mini-batches are the batch shape's alone: the train calls carry them
    # (the trainer reads them there), the parameters do not repeat them
    assert isinstance(cfg, registry.get("ppo").config)
    assert cfg.kl_coef == 0.1 and not {"ppo_epochs", "minibatches"} & set(type(cfg).model_fields)
    train = build_graph("ppo", BatchShape(**shape), {"actor", "critic", "ref", "reward"}
                        ).mfc("actor.train")
    assert (train.n_epochs, train.n_minibatches) == (2, 8)
    assert section("grpo", {}, **shape).params.samples_per_prompt == 4
    with pytest.raises(UserError, match="set ppo_minibatches on the algorithm") as e:
        section("ppo", {"minibatches": 2}, **shape)
    assert e.value.field == "algorithm.params.minibatches"
    with pytest.raises(UserError) as e:
        section("grpo", {}, samples_per_prompt=1)
    assert e.value.field == "algorithm.samples_per_prompt"
    with pytest.raises(UserError) as e:
        section("dpo", {"betta": 0.1}, **shape)
    assert e.value.field == "algorithm.params.betta"


def test_params_save_as_written_and_load_back_the_same():
    """A loaded section dumps the keys the experiment wrote (not the batch shape's, not
    the defaults), so that a saved experiment loads back to equal parameters."""
    sec = section("dapo", {"clip_ratio_high": 0.3, "max_sampling_rounds": 2},
                  samples_per_prompt=4, prompts_per_step=8, gen_len=16,
                  dropped_group_frac=0.25)
    p = sec.params
    assert (p.gen_len, p.prompts_per_step, p.dropped_group_frac) == (16, 8, 0.25)
    dumped = sec.model_dump(mode="json")
    assert dumped["params"] == {"clip_ratio_high": 0.3, "max_sampling_rounds": 2}
    assert AlgorithmSection.model_validate(dumped).params == p
    # a typed value handed in (a config built in code) is typed again for its own shape
    other = AlgorithmSection(name="dapo", params=p, samples_per_prompt=4,
                             prompts_per_step=8, gen_len=32)
    assert other.params.gen_len == 32 and other.params.clip_ratio_high == 0.3


def test_duplicates_rejected():
    a = ALGORITHMS["sft"]
    with pytest.raises(ValueError, match="'sft' registered twice"):
        registry._table(a, Algorithm("sft", a.config, a.prepare, a.losses, a.normalisers))


def _rollout(b=4, s=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 5, 6, 4])[:b]
    return {
        "tokens": torch.randint(0, 10, (b, s), generator=g),
        "lengths": lengths, "prompt_lengths": torch.tensor([2, 2, 3, 1])[:b],
        "logprobs": -torch.rand(b, s - 1, generator=g),
        "ref_logprobs": -torch.rand(b, s - 1, generator=g),
        "rewards": torch.tensor([1.0, 0.0, -1.0, 2.0])[:b],
        "greedy_rewards": torch.tensor([0.5, 0.0]),
        "values": torch.rand(b, s, generator=g),
    }


CONFIGS = {"grpo": {"samples_per_prompt": 2}, "rloo": {"samples_per_prompt": 2},
           "remax": {"samples_per_prompt": 2}, "gspo": {"samples_per_prompt": 2},
           "dr_grpo": {"samples_per_prompt": 2, "gen_len": 5},
           "rejection_sampling": {"samples_per_prompt": 2},
           "online_dpo": {"samples_per_prompt": 2},
           # 2 groups generated, 1 trained (dynamic sampling keeps the first informative)
           "dapo": {"samples_per_prompt": 2, "prompts_per_step": 1, "gen_len": 5,
                    "dropped_group_frac": 0.5}}
#: rows each prepare trains of the 4 generated (a selection for some)
ROWS = {"rejection_sampling": 2, "dapo": 2}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_prepare_then_every_loss_is_a_finite_scalar_and_descends(name):
    algo = registry.get(name)
    cfg = algo.config(**CONFIGS.get(name, {}))
    raw = _rollout()
    if name not in ("remax",):
        raw.pop("greedy_rewards")
    batch, stats = pop_stats(algo.prepare(raw, cfg))
    assert all(math.isfinite(v) for v in stats.values())
    rows = ROWS.get(name, 4)
    assert all(v.shape[0] == rows for v in batch.values())   # the engine's row check
    batch = minibatch(batch, 0, 1)          # as the train call hands it to the engine
    for role in algo.trained_roles:
        loss_fn = algo.loss_fn(role, cfg)
        pickle.loads(pickle.dumps(loss_fn))              # shippable to workers
        head_is_value = role in ("critic", "reward")
        base = batch["values"] if head_is_value else batch["logprobs"]
        theta = torch.zeros_like(base, requires_grad=True)
        loss, metrics = loss_fn(base + theta, batch)
        assert loss.dim() == 0 and torch.isfinite(loss)
        assert all(torch.as_tensor(v).dim() == 0 for v in metrics.values())
        loss.backward()
        assert theta.grad.abs().sum() > 0
        with torch.no_grad():
            after, _ = loss_fn(base + theta - 0.01 * theta.grad, batch)
        assert after < loss, (name, role)
