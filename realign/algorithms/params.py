"""The algorithms' hyper-parameters (an experiment's ``algorithm.params``), typed and
torch-free, so that the prepared run (:class:`realign.run.spec.RunSpec`) carries them
typed to every worker, the controller and the launchers without importing torch.

One class per algorithm, all on one base (unknown keys are errors, values frozen), and
the clipped policy-gradient family (PPO, GRPO, ReMax, REINFORCE++, RLOO) on a shared
base declaring what they share once. A class's ``algorithm`` names it (the tag of
:data:`AnyParams`). ``samples_per_prompt`` belongs to the batch shape
(``algorithm.samples_per_prompt``): :func:`make_params` sets it, and a class that reads
it declares it without a default. The losses that read these live with each algorithm
(:mod:`realign.algorithms.grpo`, ...).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.errors import UserError, from_validation
from planner.graph.algorithms import BatchShape

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
LossAgg = Literal["token_mean", "seq_mean_token_mean"]


class AlgorithmParams(BaseModel):
    """Base of the algorithms' hyper-parameter models: unknown keys are errors, values
    are frozen; ``algorithm`` names the algorithm (set by :func:`make_params`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: str


class ClippedPGParams(AlgorithmParams):
    """What the clipped policy-gradient family shares (PPO, GRPO, ReMax, REINFORCE++,
    RLOO). ``kl_coef``'s default is each algorithm's own."""

    kl_coef: float = Field(0.05, ge=0, description="beta: weight of the KL to the reference "
                           "(where it enters is each algorithm's: the reward or the loss).")
    clip_ratio: float = Field(0.2, gt=0, description="epsilon of the clipped surrogate.")
    behave_weight_cap: float = Field(5.0, gt=0, description="Asynchronous runs: cap of the "
                                     "behaviour importance weight pi_prox/pi_behaviour "
                                     "of the decoupled PPO loss.")


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


class DPOConfig(AlgorithmParams):
    """DPO / IPO hyper-parameters."""

    algorithm: Literal["dpo"] = "dpo"
    beta: float = Field(0.1, gt=0, description="beta: strength of the KL constraint to "
                        "the reference.")
    loss: Literal["sigmoid", "ipo"] = Field("sigmoid", description="sigmoid (DPO) or ipo.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Probability that a "
                                   "preference label is flipped (sigmoid loss only).")


class SFTConfig(AlgorithmParams):
    """SFT hyper-parameters."""

    algorithm: Literal["sft"] = "sft"
    loss_agg: LossAgg = Field("token_mean", description="One mean over all response "
                              "tokens, or per-sequence means then their mean.")


class RMConfig(AlgorithmParams):
    """Reward-modelling hyper-parameters (none yet; unknown keys are errors)."""

    algorithm: Literal["rm"] = "rm"


#: every algorithm's parameters, told apart by their ``algorithm``
AnyParams = Annotated[Union[PPOConfig, GRPOConfig, ReMaxConfig, ReinforcePPConfig,
                            RLOOConfig, DPOConfig, SFTConfig, RMConfig],
                      Field(discriminator="algorithm")]

#: algorithm name -> its parameters' class
PARAMS: Mapping[str, type[AlgorithmParams]] = {
    c.model_fields["algorithm"].default: c
    for c in (PPOConfig, GRPOConfig, ReMaxConfig, ReinforcePPConfig, RLOOConfig, DPOConfig,
              SFTConfig, RMConfig)}

#: what the batch shape sets (``algorithm.<its name>``), never ``algorithm.params``:
#: the name a user might write in params -> the batch shape's field
SHAPE_OWNED: Mapping[str, str] = {"samples_per_prompt": "samples_per_prompt",
                                  "ppo_epochs": "ppo_epochs", "minibatches": "ppo_minibatches",
                                  "ppo_minibatches": "ppo_minibatches"}


def make_params(name: str, params: Mapping[str, Any], shape: BatchShape) -> AlgorithmParams:
    """Algorithm ``name``'s parameters from the experiment's ``algorithm.params`` and the
    fields its batch shape owns; a :class:`UserError` naming ``algorithm.params.<key>``
    (or ``algorithm.<key>`` for a batch-shape field) when a value is not allowed."""
    cls = PARAMS[name]
    for key, owner in {**SHAPE_OWNED, "algorithm": "name"}.items():
        if key in params:
            raise UserError(f"set {owner} on the algorithm, not in params",
                            field=f"algorithm.params.{key}")
    from_shape = {k: getattr(shape, v) for k, v in SHAPE_OWNED.items()
                  if k in cls.model_fields}
    try:
        return cls(**params, **from_shape)
    except ValidationError as e:
        raise from_validation(e, cls, prefix="algorithm.params",
                              unknown=f"unknown hyper-parameter of {name}",
                              hidden=("algorithm", *from_shape),
                              renames={k: f"algorithm.{SHAPE_OWNED[k]}" for k in from_shape}
                              ) from None
