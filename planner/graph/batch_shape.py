"""The shape of a step's batch (prompts, samples, lengths, mini-batches, DAPO's
over-generation) and of an evaluation: what every algorithm's graph is built from
(:func:`planner.graph.algorithms.build_graph`)."""
from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

#: The largest expected share of dropped groups a plan over-generates for (20x).
MAX_DROPPED_GROUP_FRAC = 0.95


class BatchShape(BaseModel):
    """The shape of one training step's batch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts_per_step: int = Field(512, gt=0, le=1 << 24,
                                  description="Prompts (or pairs, or examples) per step.")
    samples_per_prompt: int = Field(1, gt=0, le=1 << 12, description="Responses sampled per "
                                    "prompt (GRPO/RLOO group size).")
    prompt_len: int = Field(128, gt=0, le=1 << 22,
                            description="Prompt tokens per sequence (padded bound).")
    gen_len: int = Field(256, gt=0, le=1 << 22,
                         description="Generated / response tokens per sequence, at most.")
    gen_len_mean: float | None = Field(
        None, gt=0, description="Expected response length when responses stop at the end "
        "token (gen_len is then the cap): the plan prices each wave's straggler tail, as "
        "if each token stopped a response with one fixed chance and responses past the cap "
        "were cut at it. None: every response runs to gen_len.")
    ppo_minibatches: int = Field(4, gt=0, le=1 << 20,
                                 description="Optimizer steps per epoch over the batch.")
    ppo_epochs: int = Field(1, gt=0, le=1 << 20, description="Epochs over each batch.")
    dropped_group_frac: float | None = Field(
        None, ge=0, le=MAX_DROPPED_GROUP_FRAC, description="DAPO's dynamic sampling: the "
        "expected share of prompts whose samples all get the same reward (their groups are "
        "dropped), measured on earlier steps or given. The step generates "
        "prompts_generated = ceil(prompts_per_step / (1 - share)) prompts' groups so that "
        "prompts_per_step are expected to remain, and the plan prices that generation. "
        "None: no over-generation (0). Only DAPO drops groups.")

    @property
    def prompts_generated(self) -> int:
        """The prompts a step draws and generates for (:func:`prompts_generated`)."""
        return prompts_generated(self.prompts_per_step, self.dropped_group_frac or 0.0)


def prompts_generated(prompts_per_step: int, dropped_group_frac: float) -> int:
    """The prompts to generate for so that ``prompts_per_step`` are expected to remain
    when a share ``dropped_group_frac`` of the groups is dropped: ceil(P / (1 - f)).

    Example: 16 prompts per step, a quarter of the groups expected constant ->
    ceil(16 / 0.75) = 22 prompts generated (5.5 expected dropped, 16.5 left); 0 -> 16."""
    # the small tolerance keeps an exact quotient (16 / 0.5) from rounding up on a float
    return max(prompts_per_step, math.ceil(prompts_per_step / (1 - dropped_group_frac) - 1e-9))


class EvalShape(BaseModel):
    """The shape of an evaluation on held-out prompts (the experiment's ``eval`` section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_prompts: int = Field(gt=0, le=1 << 20, description="Held-out prompts per evaluation.")
    samples: int = Field(4, gt=0, le=1 << 10, description="Sampled responses per prompt (k "
                         "of pass@k); a greedy response is made too.")
    every: int = Field(10, gt=0, description="Steps between evaluations.")
