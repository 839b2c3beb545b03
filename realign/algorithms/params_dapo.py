"""DAPO's hyper-parameters (an experiment's ``algorithm.params`` of ``name: dapo``) and
what its sampling rounds read from them (:func:`max_sampling_rounds`,
:func:`max_round_prompts`); re-exported by :mod:`realign.algorithms.params`."""
from __future__ import annotations

from typing import Collection, Literal

from pydantic import Field, model_validator

from planner.errors import UserError
from planner.graph.algorithms import MAX_DROPPED_GROUP_FRAC
from planner.graph.batch_shape import prompts_generated
from planner.graph.sampling_rounds import (
    DEFAULT_ROUND_CAP_FACTOR,
    MAX_ROUND_PROMPTS,
    MAX_SAMPLING_ROUNDS,
)
from realign.algorithms.param_paths import contradiction
from realign.algorithms.params_base import AlgorithmParams, ClipHigherParams, KLEstimator


class DAPOConfig(ClipHigherParams):
    """DAPO hyper-parameters (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale", arXiv 2503.14476); defaults are the paper's."""

    algorithm: Literal["dapo"] = "dapo"
    samples_per_prompt: int = Field(ge=2, description="G: responses per prompt, on "
                                    "consecutive rows (the batch shape's).")
    prompts_per_step: int = Field(gt=0, description="Groups trained per step (the batch "
                                  "shape's); dynamic sampling keeps this many.")
    gen_len: int = Field(gt=0, description="L_max of the overlong shaping: the generation "
                         "cap (the batch shape's).")
    dropped_group_frac: float | None = Field(None, ge=0, le=MAX_DROPPED_GROUP_FRAC,
                                             description="The batch shape's: the expected "
                                             "share of constant groups generated for.")
    kl_coef: float = Field(0.0, ge=0, description="beta: weight of the KL loss to the "
                           "reference (DAPO drops the KL term: 0).")
    kl_estimator: KLEstimator = Field("k3", description="KL estimator of the KL loss.")
    clip_ratio: float = Field(0.2, gt=0, lt=1, description="epsilon_low: the ratio is "
                              "clipped below at 1 - epsilon_low (the paper's 0.2).")
    clip_ratio_high: float = Field(0.28, gt=0, description="epsilon_high (clip-higher): "
                                   "the ratio is clipped above at 1 + epsilon_high (the "
                                   "paper's 0.28), so unlikely tokens can grow more.")
    eps: float = Field(1e-6, gt=0, description="Added to the group std.")
    dynamic_sampling: bool = Field(True, description="Drop the groups whose samples all "
                                   "got the same reward and train on prompts_per_step of "
                                   "the rest (the step generates for prompts_generated).")
    overlong_buffer_frac: float = Field(0.2, ge=0, lt=1, description="L_cache / L_max of "
                                        "the overlong reward shaping: a response longer "
                                        "than (1 - this) * gen_len loses up to "
                                        "overlong_penalty, linearly (the paper's 4096 of "
                                        "20480 tokens: 0.2); the buffer, round(this * "
                                        "gen_len) tokens, is 1 to gen_len - 1 tokens; 0: "
                                        "no shaping.")
    overlong_penalty: float = Field(1.0, ge=0, description="The most the overlong shaping "
                                    "takes off a reward (the paper's 1).")
    max_sampling_rounds: int = Field(
        1, ge=1, le=MAX_SAMPLING_ROUNDS, description="Dynamic sampling as the paper does it: "
        "a step generates for prompts_generated prompts, keeps the informative groups, and "
        "generates again (new prompts, seeds from the step and the round; a later round "
        "sized from the drop rate seen, at most max_round_prompts) until prompts_per_step "
        "are kept or this many rounds have run; a step still short then trains its "
        "informative groups with constant ones at loss weight 0 (the metrics say so). The "
        "plan prices the expected prompts at the drop rate plan.lengths_from recorded, else "
        "algorithm.dropped_group_frac. 1: one round (over-generation only).")
    max_round_prompts: int | None = Field(
        None, ge=1, le=MAX_ROUND_PROMPTS, description="The most prompts a later sampling "
        "round generates for. A later round is sized from the drop rate measured so far "
        "(this step's rounds and earlier steps'): the missing groups over the share kept, "
        "with a margin (planner.graph.sampling_rounds.round_size), at most this many. None: "
        "8 x prompts_generated. Its rollout runs in more waves and micro-batches than the "
        "first round's, each no larger, so the plan's memory holds; its time grows with "
        "it. A later round's prompts are a multiple of the quantum: the fewest prompts whose "
        "rows split evenly over every data-parallel rank of the rollout and of the calls "
        "that score it (1 where samples_per_prompt is a multiple of those ranks); a cap "
        "below the quantum is refused when the run is prepared (exit 2). The plan prices "
        "later rounds in multiples of one prompt (the data-parallel sizes are what its "
        "search chooses), so where the run's quantum is q > 1 a later round can generate "
        "for up to q - 1 prompts more than priced. Needs max_sampling_rounds > 1.")

    @model_validator(mode="after")
    def _over_generation_needs_dynamic_sampling(self) -> "DAPOConfig":
        if self.dropped_group_frac and not self.dynamic_sampling:
            raise UserError(f"algorithm.dropped_group_frac {self.dropped_group_frac} makes "
                            "the step generate for more prompts than it trains, which only "
                            "dynamic sampling drops; set dynamic_sampling: true or the "
                            "share to 0", field="algorithm.params.dynamic_sampling")
        if self.max_sampling_rounds > 1 and not self.dynamic_sampling:
            raise UserError(f"max_sampling_rounds {self.max_sampling_rounds} samples again "
                            "for the groups dynamic sampling drops; set dynamic_sampling: "
                            "true or max_sampling_rounds to 1",
                            field="algorithm.params.max_sampling_rounds")
        if self.max_round_prompts is not None and self.max_sampling_rounds == 1:
            raise contradiction("max_round_prompts", self.max_round_prompts,
                                "max_sampling_rounds", 1, "max_round_prompts with "
                                "max_sampling_rounds above 1 (one round samples no later "
                                "round); raise max_sampling_rounds or leave "
                                "max_round_prompts out")
        return self

    @model_validator(mode="after")
    def _overlong_buffer_in_tokens(self) -> "DAPOConfig":
        frac, n = self.overlong_buffer_frac, self.gen_len
        if frac > 0 and not 1 <= round(frac * n) <= n - 1:
            allowed = ("0 (no shaping): a gen_len of 1 token leaves no room for a buffer"
                       if n < 2 else
                       f"0 (no shaping), or a buffer of 1 to gen_len - 1 tokens: above "
                       f"{0.5 / n:.6g} and below {(n - 0.5) / n:.6g}")
            raise contradiction("overlong_buffer_frac", frac, "gen_len", n,
                                f"{allowed} (this one is round({frac * n:.6g}) = "
                                f"{round(frac * n)} tokens)")
        return self

    def check_written(self, written: Collection[str]) -> None:
        """An ``overlong_penalty`` written where ``overlong_buffer_frac`` 0 turns the
        shaping off, or an ``overlong_buffer_frac`` written where ``overlong_penalty``
        0 does."""
        super().check_written(written)
        if ("overlong_penalty" in written and self.overlong_penalty > 0
                and self.overlong_buffer_frac == 0):
            raise contradiction("overlong_penalty", self.overlong_penalty,
                                "overlong_buffer_frac", 0.0, "a penalty with a buffer above "
                                "0 (a buffer of 0 turns the shaping off); give the buffer, "
                                "or leave overlong_penalty out")
        if ("overlong_buffer_frac" in written and self.overlong_buffer_frac > 0
                and self.overlong_penalty == 0):
            raise contradiction("overlong_buffer_frac", self.overlong_buffer_frac,
                                "overlong_penalty", 0.0, "a buffer with a penalty above 0 "
                                "(a penalty of 0 turns the shaping off); give the penalty, "
                                "or leave overlong_buffer_frac out")


def max_sampling_rounds(params: AlgorithmParams) -> int:
    """The most sampling rounds a step takes: DAPO's ``max_sampling_rounds`` with dynamic
    sampling on, else 1."""
    if isinstance(params, DAPOConfig) and params.dynamic_sampling:
        return params.max_sampling_rounds
    return 1


def max_round_prompts(params: AlgorithmParams) -> int:
    """The most prompts a later sampling round of DAPO generates for: its
    ``max_round_prompts``, else :data:`~planner.graph.sampling_rounds.DEFAULT_ROUND_CAP_FACTOR`
    first rounds (``prompts_generated``); 0 where a step samples once."""
    if max_sampling_rounds(params) == 1:
        return 0
    assert isinstance(params, DAPOConfig), "only DAPO samples in rounds"
    if params.max_round_prompts is not None:
        return params.max_round_prompts
    return DEFAULT_ROUND_CAP_FACTOR * prompts_generated(params.prompts_per_step,
                                                        params.dropped_group_frac or 0.0)
