"""The algorithms' hyper-parameters (an experiment's ``algorithm.params``), typed and
torch-free, so that the prepared run (:class:`realign.run.spec.RunSpec`) carries them
typed to every worker, the controller and the launchers without importing torch.

One class per algorithm, all on one base (unknown keys are errors, values frozen), the
clipped policy-gradient family (PPO, GRPO, ReMax, REINFORCE++, RLOO, DAPO, GSPO, Dr.
GRPO) on a shared base declaring what they share once (DAPO and GSPO on one that adds
the upper clip range), and the preference losses (DPO, online DPO) on another. The
bases are in :mod:`realign.algorithms.params_base`, DAPO's in
:mod:`realign.algorithms.params_dapo`; this module re-exports both.
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

from typing import Literal

from pydantic import Field, model_validator

from realign.algorithms.param_paths import contradiction
from realign.algorithms.params_base import (
    AlgorithmParams,
    ClipHigherParams,
    ClippedPGParams,
    KLEstimator,
    LossAgg,
)
from realign.algorithms.params_dapo import DAPOConfig, max_round_prompts, max_sampling_rounds

#: the names callers import from here (the bases and DAPO's live in their own modules)
__all__ = ["AlgorithmParams", "ClipHigherParams", "ClippedPGParams", "DAPOConfig",
           "DPOConfig", "DrGRPOConfig", "GRPOConfig", "GSPOConfig", "KLEstimator", "LossAgg",
           "OnlineDPOConfig", "PPOConfig", "PreferenceParams", "RLOOConfig", "RMConfig",
           "ReMaxConfig", "ReinforcePPConfig", "RejectionSamplingConfig", "SFTConfig",
           "max_round_prompts", "max_sampling_rounds"]


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
