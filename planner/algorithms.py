"""One dataflow-graph builder per algorithm, from the batch shape.

PPO / GRPO / ReMax / REINFORCE++ / RLOO generate with the actor and score with the
reference and the reward; DPO scores preference pairs with the reference; SFT and
reward modelling are a single training call. The reward is a model call when a
``reward`` model is configured, else a rule function on the controller (no MFC).
The reference is optional for the RL algorithms (:data:`OPTIONAL_ROLES`): without a
``ref`` model the graph has no reference call, which is right only when the KL
coefficient is 0 (realign's run checks that against the hyper-parameters).
"""
from __future__ import annotations

from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import PlanError
from planner.graph import MFC, DataflowGraph

Algorithm = Literal["ppo", "grpo", "remax", "reinforce_pp", "rloo", "dpo", "sft", "rm"]

#: Roles each algorithm needs.
REQUIRED_ROLES: dict[str, tuple[str, ...]] = {
    "ppo": ("actor", "critic", "reward"),
    "grpo": ("actor",),
    "remax": ("actor",),
    "reinforce_pp": ("actor",),
    "rloo": ("actor",),
    "dpo": ("actor", "ref"),
    "sft": ("actor",),
    "rm": ("reward",),
}

#: Roles an algorithm uses when configured and does without otherwise.
OPTIONAL_ROLES: dict[str, tuple[str, ...]] = {
    "ppo": ("ref",),
    "grpo": ("ref", "reward"),
    "remax": ("ref", "reward"),
    "reinforce_pp": ("ref", "reward"),
    "rloo": ("ref", "reward"),
    "dpo": (),
    "sft": (),
    "rm": (),
}


class BatchShape(BaseModel):
    """The shape of one training step's batch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts_per_step: int = Field(512, gt=0, description="Prompts (or pairs, or examples) per step.")
    samples_per_prompt: int = Field(1, gt=0, description="Responses sampled per prompt (GRPO/RLOO group size).")
    prompt_len: int = Field(128, gt=0, description="Prompt tokens per sequence (padded bound).")
    gen_len: int = Field(256, gt=0, description="Generated / response tokens per sequence.")
    ppo_minibatches: int = Field(4, gt=0, description="Optimizer steps per epoch over the batch.")
    ppo_epochs: int = Field(1, gt=0, description="Epochs over each batch.")


def _rollout(shape: BatchShape, n: int, with_reward_model: bool, with_ref: bool) -> list[MFC]:
    """actor.generate, then the reward (if a model) and the reference (if one) scoring."""
    p, g = shape.prompt_len, shape.gen_len
    calls = [MFC(name="actor.generate", role="actor", kind="generate", n_seqs=n,
                 prompt_len=p, gen_len=g, input_keys=("prompts",),
                 output_keys=("seqs", "logprobs"))]
    if with_reward_model:
        calls.append(MFC(name="reward.inference", role="reward", kind="inference", n_seqs=n,
                         prompt_len=p, gen_len=g, input_keys=("seqs",), output_keys=("rewards",)))
    if with_ref:
        calls.append(MFC(name="ref.inference", role="ref", kind="inference", n_seqs=n,
                         prompt_len=p, gen_len=g, input_keys=("seqs",),
                         output_keys=("ref_logprobs",)))
    return calls


def _actor_train(shape: BatchShape, n: int, inputs: tuple[str, ...], group_size: int = 1) -> MFC:
    return MFC(name="actor.train", role="actor", kind="train", n_seqs=n,
               prompt_len=shape.prompt_len, gen_len=shape.gen_len, input_keys=inputs,
               output_keys=("actor_stats",), n_minibatches=shape.ppo_minibatches,
               n_epochs=shape.ppo_epochs, group_size=group_size)


def ppo(shape: BatchShape, with_reward_model: bool = True, with_ref: bool = True) -> list[MFC]:
    n = shape.prompts_per_step * shape.samples_per_prompt
    p, g = shape.prompt_len, shape.gen_len
    calls = _rollout(shape, n, with_reward_model, with_ref)
    calls.append(MFC(name="critic.inference", role="critic", kind="inference", n_seqs=n,
                     prompt_len=p, gen_len=g, input_keys=("seqs",), output_keys=("values",)))
    ins = (("seqs", "logprobs") + (("ref_logprobs",) if with_ref else ()) + ("values",)
           + (("rewards",) if with_reward_model else ()))
    calls.append(_actor_train(shape, n, ins))
    calls.append(MFC(name="critic.train", role="critic", kind="train", n_seqs=n, prompt_len=p,
                     gen_len=g, input_keys=ins, output_keys=("critic_stats",),
                     n_minibatches=shape.ppo_minibatches, n_epochs=shape.ppo_epochs))
    return calls


def _critic_free(shape: BatchShape, with_reward_model: bool, with_ref: bool = True
                 ) -> list[MFC]:
    """GRPO, REINFORCE++ and RLOO share one graph; they differ in the advantage."""
    n = shape.prompts_per_step * shape.samples_per_prompt
    calls = _rollout(shape, n, with_reward_model, with_ref)
    ins = (("seqs", "logprobs") + (("ref_logprobs",) if with_ref else ())
           + (("rewards",) if with_reward_model else ()))
    return calls + [_actor_train(shape, n, ins)]


def remax(shape: BatchShape, with_reward_model: bool = True, with_ref: bool = True
          ) -> list[MFC]:
    """ReMax: a sampled and a greedy rollout; the greedy reward is the baseline."""
    n = shape.prompts_per_step * shape.samples_per_prompt
    p, g = shape.prompt_len, shape.gen_len
    calls = _rollout(shape, n, with_reward_model, with_ref)
    calls.insert(1, MFC(name="actor.greedy_generate", role="actor", kind="generate",
                        n_seqs=shape.prompts_per_step, prompt_len=p, gen_len=g,
                        input_keys=("prompts",), output_keys=("greedy_seqs",)))
    ins = ("seqs", "logprobs") + (("ref_logprobs",) if with_ref else ())
    if with_reward_model:
        calls.insert(3, MFC(name="reward.greedy_inference", role="reward", kind="inference",
                            n_seqs=shape.prompts_per_step, prompt_len=p, gen_len=g,
                            input_keys=("greedy_seqs",), output_keys=("greedy_rewards",)))
        ins += ("rewards", "greedy_rewards")
    else:
        ins += ("greedy_seqs",)
    return calls + [_actor_train(shape, n, ins)]


def dpo(shape: BatchShape, with_reward_model: bool = False, with_ref: bool = True
        ) -> list[MFC]:
    """DPO: the reference scores chosen and rejected responses, the actor trains."""
    n = 2 * shape.prompts_per_step
    p, g = shape.prompt_len, shape.gen_len
    return [
        MFC(name="ref.inference", role="ref", kind="inference", n_seqs=n, prompt_len=p,
            gen_len=g, input_keys=("pairs",), output_keys=("ref_logprobs",)),
        _actor_train(shape, n, ("pairs", "ref_logprobs"), group_size=2),   # whole pairs
    ]


def sft(shape: BatchShape, with_reward_model: bool = False, with_ref: bool = False
        ) -> list[MFC]:
    return [_actor_train(shape, shape.prompts_per_step, ("examples",))]


def rm(shape: BatchShape, with_reward_model: bool = True, with_ref: bool = False
       ) -> list[MFC]:
    """Reward modelling: pairwise Bradley-Terry on chosen/rejected responses."""
    return [MFC(name="reward.train", role="reward", kind="train",
                n_seqs=2 * shape.prompts_per_step, prompt_len=shape.prompt_len,
                gen_len=shape.gen_len, input_keys=("pairs",), output_keys=("reward_stats",),
                n_minibatches=shape.ppo_minibatches, n_epochs=shape.ppo_epochs,
                group_size=2)]


BUILDERS: dict[str, Callable[..., list[MFC]]] = {
    "ppo": ppo,
    "grpo": _critic_free,
    "reinforce_pp": _critic_free,
    "rloo": _critic_free,
    "remax": remax,
    "dpo": dpo,
    "sft": sft,
    "rm": rm,
}


def build_graph(algorithm: str, shape: BatchShape, roles: set[str]) -> DataflowGraph:
    """The dataflow graph of ``algorithm`` for the configured model ``roles``."""
    if algorithm not in BUILDERS:
        raise PlanError(f"unknown algorithm {algorithm!r}; allowed: "
                        f"{', '.join(BUILDERS)}", field="algorithm.name")
    missing = [r for r in REQUIRED_ROLES[algorithm] if r not in roles]
    if missing:
        raise PlanError(f"{algorithm} needs the model role(s) {', '.join(missing)}",
                        field="models")
    with_rm = "reward" in roles and algorithm not in ("dpo", "sft")
    calls = BUILDERS[algorithm](shape, with_reward_model=with_rm, with_ref="ref" in roles)
    used = {m.role for m in calls}
    assert used <= set(REQUIRED_ROLES[algorithm]) | set(OPTIONAL_ROLES[algorithm]), used
    extra = sorted(roles - used)
    if extra:
        raise PlanError(f"{algorithm} does not use the model role(s) {', '.join(extra)}; "
                        f"remove them", field="models")
    return DataflowGraph(algorithm=algorithm, mfcs=tuple(calls))
