"""The algorithms' hyper-parameters (an experiment's ``algorithm.params``), typed and
torch-free, so that the prepared run (:class:`realign.run.spec.RunSpec`) carries them
typed to every worker, the controller and the launchers without importing torch.

One class per algorithm, all on one base (unknown keys are errors, values frozen), the
clipped policy-gradient family (PPO, GRPO, ReMax, REINFORCE++, RLOO, DAPO, GSPO, Dr.
GRPO) on a shared base declaring what they share once (DAPO and GSPO on one that adds
the upper clip range), and the preference losses (DPO, online DPO) on another.
Parameters that contradict each other are refused
(:func:`~realign.algorithms.param_paths.contradiction`; the pairs: docs/algorithms.md):
values alone in validators, keys the experiment wrote together in
:meth:`AlgorithmParams.check_written`. A class's ``algorithm`` names it (the tag of
:data:`~realign.algorithms.params_table.AnyParams`). ``samples_per_prompt`` belongs to
the batch shape (``algorithm.samples_per_prompt``), as do ``prompts_per_step``,
``gen_len`` and ``dropped_group_frac``: :func:`~realign.algorithms.params_table.make_params`
sets them, and a class that reads one declares it without a default. The losses that
read these live with each algorithm (:mod:`realign.algorithms.grpo`, ...).
"""
from __future__ import annotations

from typing import Any, Collection, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.errors import UserError
from planner.graph.algorithms import MAX_DROPPED_GROUP_FRAC
from planner.graph.batch_shape import prompts_generated
from planner.graph.sampling_rounds import (
    DEFAULT_ROUND_CAP_FACTOR,
    MAX_ROUND_PROMPTS,
    MAX_SAMPLING_ROUNDS,
)
from realign.algorithms.param_paths import SHAPE_OWNED, contradiction

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
LossAgg = Literal["token_mean", "seq_mean_token_mean"]


class AlgorithmParams(BaseModel):
    """Base of the algorithms' hyper-parameter models: unknown keys are errors, values
    are frozen; ``algorithm`` names the algorithm (set by
    :func:`~realign.algorithms.params_table.make_params`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: str

    def written(self) -> dict[str, Any]:
        """The keys the experiment wrote in ``algorithm.params`` with their values (what
        an experiment's ``algorithm.params`` saves as): neither ``algorithm`` nor a
        field the batch shape sets."""
        return self.model_dump(mode="json", include=self.model_fields_set
                               - {"algorithm", *SHAPE_OWNED})

    def check_written(self, written: Collection[str]) -> None:
        """A :class:`UserError` where keys the experiment wrote (``written``, its
        ``algorithm.params``) contradict each other: a value that another one makes
        unused. Checks of values alone are validators (they hold for a reloaded run too,
        which has every field written)."""


class ClippedPGParams(AlgorithmParams):
    """What the clipped policy-gradient family shares (PPO, GRPO, ReMax, REINFORCE++,
    RLOO, DAPO, GSPO, Dr. GRPO). ``kl_coef``'s default is each algorithm's own."""

    kl_coef: float = Field(0.05, ge=0, description="beta: weight of the KL to the reference "
                           "(where it enters is each algorithm's: the reward or the loss).")
    clip_ratio: float = Field(0.2, gt=0, lt=1, description="epsilon of the clipped "
                              "surrogate: the ratio is clipped to [1 - epsilon, 1 + "
                              "epsilon], a range of positive ratios.")
    behave_weight_cap: float = Field(5.0, ge=1, description="Asynchronous runs: cap of the "
                                     "behaviour importance weight pi_prox/pi_behaviour "
                                     "of the decoupled PPO loss (at least 1, the weight "
                                     "of an on-policy token).")
    tis_cap: float | None = Field(
        None, ge=1, description="Truncated importance sampling (Yao et al. 2025, \"Your "
        "Efficient RL Framework Secretly Brings You Off-Policy RL Training\"): the actor's "
        "training forward scores the rollout before the update (actor.prox_inference, "
        "priced by the plan) and each token's clipped loss, taken against those log-probs, "
        "is weighted by min(pi_train / pi_rollout, tis_cap): the correction for a rollout "
        "engine (vLLM) whose log-probs differ from training's. At least 1. Asynchronous "
        "runs use it in place of behave_weight_cap (so the two are not written with "
        "different values). None: off.")

    @property
    def importance_cap(self) -> float:
        """The cap of the behaviour importance weight: ``tis_cap`` when set, else
        ``behave_weight_cap``."""
        return self.tis_cap if self.tis_cap is not None else self.behave_weight_cap

    def check_written(self, written: Collection[str]) -> None:
        """``behave_weight_cap`` written beside a ``tis_cap`` of another value, which
        takes its place."""
        super().check_written(written)
        if (self.tis_cap is not None and "behave_weight_cap" in written
                and self.behave_weight_cap != self.tis_cap):
            raise contradiction("behave_weight_cap", self.behave_weight_cap, "tis_cap",
                                self.tis_cap, "one cap: tis_cap caps every importance "
                                "weight (asynchronous runs' too) in place of "
                                "behave_weight_cap; leave behave_weight_cap out")


class ClipHigherParams(ClippedPGParams):
    """A clipped policy gradient with an upper clip range of its own (DAPO, GSPO): the
    ratio is clipped to [1 - clip_ratio, 1 + clip_ratio_high], never narrower above
    than below."""

    clip_ratio: float = Field(0.2, gt=0, lt=1, description="epsilon_low: the ratio is "
                              "clipped below at 1 - epsilon_low.")
    clip_ratio_high: float = Field(0.28, gt=0, description="epsilon_high: the ratio is "
                                   "clipped above at 1 + epsilon_high (at least "
                                   "clip_ratio).")

    @model_validator(mode="after")
    def _clip_higher(self) -> "ClipHigherParams":
        if self.clip_ratio_high < self.clip_ratio:
            raise contradiction(
                "clip_ratio_high", self.clip_ratio_high, "clip_ratio", self.clip_ratio,
                f"clip_ratio_high >= clip_ratio (these clip the ratio to "
                f"[{1 - self.clip_ratio:.6g}, {1 + self.clip_ratio_high:.6g}], narrower above "
                "than below: swapped bounds?)")
        return self


class PPOConfig(ClippedPGParams):
    """PPO hyper-parameters."""

    algorithm: Literal["ppo"] = "ppo"
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    kl_in_reward: bool = Field(True, description="Subtract beta * KL from the per-token "
                               "reward (InstructGPT); else add beta * KL to the actor loss.")
    kl_estimator: KLEstimator = Field("k1", description="KL estimator (k1 in the reward; "
                                      "k3 is the usual choice as a loss).")
    value_clip: float = Field(0.2, gt=0, description="Clip range of the critic's values "
                              "around the old values.")
    normalize_advantages: bool = Field(True, description="Whiten advantages over the "
                                       "batch's response tokens.")


class GRPOConfig(ClippedPGParams):
    """GRPO hyper-parameters."""

    algorithm: Literal["grpo"] = "grpo"
    samples_per_prompt: int = Field(ge=2, description="G: responses per prompt, on "
                                    "consecutive rows (the batch shape's).")
    kl_coef: float = Field(0.04, ge=0, description="beta: weight of the KL loss to the "
                           "reference (the paper's 0.04).")
    kl_estimator: KLEstimator = Field("k3", description="KL estimator of the KL loss.")
    eps: float = Field(1e-6, gt=0, description="Added to the group std.")
    loss_agg: LossAgg = Field("seq_mean_token_mean", description="Per-sequence token mean "
                              "then mean (the paper) or one mean over all tokens.")


class ReMaxConfig(ClippedPGParams):
    """ReMax hyper-parameters."""

    algorithm: Literal["remax"] = "remax"
    samples_per_prompt: int = Field(ge=1, description="Sampled responses per prompt "
                                    "(consecutive rows; the batch shape's); each prompt "
                                    "has one greedy baseline.")


class ReinforcePPConfig(ClippedPGParams):
    """REINFORCE++ hyper-parameters."""

    algorithm: Literal["reinforce_pp"] = "reinforce_pp"
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor.")
    kl_coef: float = Field(0.01, ge=0, description="beta: per-token KL(pi || pi_ref) "
                           "penalty in the reward.")


class RLOOConfig(ClippedPGParams):
    """RLOO hyper-parameters."""

    algorithm: Literal["rloo"] = "rloo"
    samples_per_prompt: int = Field(ge=2, description="k: responses per prompt, on "
                                    "consecutive rows (the batch shape's).")


class PreferenceParams(AlgorithmParams):
    """What the preference losses share (DPO, online DPO)."""

    beta: float = Field(0.1, gt=0, description="beta: strength of the KL constraint to "
                        "the reference.")
    loss: Literal["sigmoid", "ipo"] = Field("sigmoid", description="sigmoid (DPO) or ipo.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Probability that a "
                                   "preference label is flipped (sigmoid loss only: 0 "
                                   "with ipo).")

    @model_validator(mode="after")
    def _smoothing_needs_sigmoid(self) -> "PreferenceParams":
        if self.label_smoothing > 0 and self.loss != "sigmoid":
            raise contradiction("label_smoothing", self.label_smoothing, "loss", self.loss,
                                "label_smoothing 0 with loss ipo (the IPO loss has no "
                                "label noise term); smoothing needs loss sigmoid")
        return self


class DPOConfig(PreferenceParams):
    """DPO / IPO hyper-parameters."""

    algorithm: Literal["dpo"] = "dpo"


class SFTConfig(AlgorithmParams):
    """SFT hyper-parameters."""

    algorithm: Literal["sft"] = "sft"
    loss_agg: LossAgg = Field("token_mean", description="One mean over all response "
                              "tokens, or per-sequence means then their mean.")


class RMConfig(AlgorithmParams):
    """Reward-modelling hyper-parameters (none yet; unknown keys are errors)."""

    algorithm: Literal["rm"] = "rm"


class RejectionSamplingConfig(AlgorithmParams):
    """Rejection sampling (best-of-N fine-tuning; RAFT, Dong et al. 2023) hyper-parameters."""

    algorithm: Literal["rejection_sampling"] = "rejection_sampling"
    samples_per_prompt: int = Field(ge=2, description="N: responses per prompt, on "
                                    "consecutive rows (the batch shape's); the best is kept.")
    min_reward: float | None = Field(None, description="A prompt's best response is trained "
                                     "on only if it scores at least this (the others weigh "
                                     "0 in the loss); None: always.")
    loss_agg: LossAgg = Field("token_mean", description="SFT's: one mean over all kept "
                              "response tokens, or per-sequence means then their mean.")


class OnlineDPOConfig(PreferenceParams):
    """Online (iterative) DPO hyper-parameters (Guo et al. 2024, "Direct Language Model
    Alignment from Online AI Feedback"; Xiong et al. 2024, "Iterative Preference
    Learning from Human Feedback"). ``beta`` 0.1 is Guo et al.'s."""

    algorithm: Literal["online_dpo"] = "online_dpo"
    samples_per_prompt: int = Field(ge=2, description="Responses per prompt, on consecutive "
                                    "rows (the batch shape's); the best and the worst make "
                                    "the pair.")


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


class GSPOConfig(ClipHigherParams):
    """GSPO hyper-parameters (Zheng et al. 2025, "Group Sequence Policy Optimization",
    arXiv 2507.18071): one importance ratio and one clip per sequence."""

    algorithm: Literal["gspo"] = "gspo"
    samples_per_prompt: int = Field(ge=2, description="G: responses per prompt, on "
                                    "consecutive rows (the batch shape's).")
    clip_ratio: float = Field(3e-4, gt=0, lt=1, description="Left clip range of the "
                              "sequence ratio (the paper's 3e-4: a length-normalised "
                              "ratio moves far less than a token's).")
    clip_ratio_high: float = Field(4e-4, gt=0, description="Right clip range of the "
                                   "sequence ratio (the paper's 4e-4).")
    kl_coef: float = Field(0.0, ge=0, description="beta: weight of the KL loss to the "
                           "reference (0: none, and no reference model needed).")
    kl_estimator: KLEstimator = Field("k3", description="KL estimator of the KL loss.")
    eps: float = Field(1e-6, gt=0, description="Added to the group std.")


class DrGRPOConfig(ClippedPGParams):
    """Dr. GRPO hyper-parameters (Liu et al. 2025, "Understanding R1-Zero-Like Training:
    A Critical Perspective", arXiv 2503.20783): GRPO without the group std and the
    response-length normalisation."""

    algorithm: Literal["dr_grpo"] = "dr_grpo"
    samples_per_prompt: int = Field(ge=2, description="G: responses per prompt, on "
                                    "consecutive rows (the batch shape's).")
    gen_len: int = Field(gt=0, description="The constant each sequence's token sum is "
                         "divided by: the generation cap (the batch shape's).")
    kl_coef: float = Field(0.0, ge=0, description="beta: weight of the KL loss to the "
                           "reference (0: none, and no reference model needed).")
    kl_estimator: KLEstimator = Field("k3", description="KL estimator of the KL loss.")


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
