"""The bases of the algorithms' hyper-parameter models (:mod:`realign.algorithms.params`):
every algorithm's (unknown keys are errors, values frozen), the clipped policy-gradient
family's, and the one with an upper clip range of its own (DAPO, GSPO)."""
from __future__ import annotations

from typing import Any, Collection, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
