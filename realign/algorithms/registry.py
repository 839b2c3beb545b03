"""The table of algorithms by name: each entry is its hyper-parameter class, its
``prepare`` step and, per trained model role, a factory of the training engine's loss
function. This is the torch half of an algorithm; its torch-free half (data kind,
roles, dataflow graph) is :data:`planner.graph.algorithms.ALGORITHMS` under the same name
(:attr:`Algorithm.spec`): ``actor.train`` trains with ``loss_fn("actor", cfg)``,
``critic.train`` with ``loss_fn("critic", cfg)``, ``reward.train`` with
``loss_fn("reward", cfg)``.

Use::

    algo = registry.get(exp.algorithm.name)
    cfg = exp.algorithm.params                 # typed when the experiment was loaded
    batch = algo.prepare(scored_rollout, cfg)          # adds advantages, returns, ...
    engine.train_step(minibatch, algo.loss_fn("actor", cfg))
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Generic, Mapping, TypeVar

from planner.graph.algorithms import ALGORITHMS as SPECS
from planner.graph.algorithms import AlgorithmSpec
from realign.algorithms import (
    dapo,
    dpo,
    dr_grpo,
    grpo,
    gspo,
    online_dpo,
    ppo,
    reinforce_pp,
    rejection_sampling,
    remax,
    rloo,
    rm,
    sft,
)
from realign.algorithms.common import (
    Batch,
    LossFn,
    RowWeights,
    TrainLoss,
    aggregate_weights,
    batch_mask,
    loss_mask_of,
    per_row,
)
from realign.algorithms.params import (
    AlgorithmParams,
    GRPOConfig,
    RejectionSamplingConfig,
    SFTConfig,
)
from realign.errors import UserError

#: An algorithm's hyper-parameter class.
P = TypeVar("P", bound=AlgorithmParams)


@dataclass(frozen=True)
class Algorithm(Generic[P]):
    """One algorithm: ``config`` (pydantic class), ``prepare(batch, cfg) -> batch`` (in
    the train call on each of its workers, after scoring, before training; it may
    choose the rows to train, :mod:`realign.algorithms.selection`) and ``losses``: trained role ->
    ``factory(cfg) -> loss_fn``; ``normalisers``: trained role -> ``factory(cfg) ->
    weights``, each row's count in the denominator of that loss's mean
    (:class:`~realign.algorithms.common.TrainLoss`)."""

    name: str
    config: type[P]
    prepare: Callable[[Batch, P], Batch]
    losses: Mapping[str, Callable[[P], LossFn]]
    normalisers: Mapping[str, Callable[[P], RowWeights]]

    def __post_init__(self) -> None:
        if set(self.losses) != set(self.normalisers):
            raise ValueError(f"algorithm {self.name!r}: losses for {sorted(self.losses)}, "
                             f"normalisers for {sorted(self.normalisers)}")

    @property
    def trained_roles(self) -> tuple[str, ...]:
        return tuple(self.losses)

    @property
    def spec(self) -> AlgorithmSpec:
        """The torch-free half: data kind, model roles, dataflow graph."""
        return SPECS[self.name]

    def check_roles(self, cfg: AlgorithmParams, roles: set[str]) -> None:
        """The configured model ``roles`` suit ``cfg``: a KL coefficient above 0 needs
        the reference model that the algorithm otherwise does without."""
        kl_coef = getattr(cfg, "kl_coef", 0.0)
        if "ref" in self.spec.optional_roles and "ref" not in roles and kl_coef > 0:
            raise UserError(f"{self.name} with kl_coef {kl_coef} needs a reference model: "
                            "set models.ref, or algorithm.params.kl_coef: 0 to train "
                            "without one", field="models.ref")

    def loss_fn(self, role: str, cfg: AlgorithmParams) -> TrainLoss:
        """The loss function that trains model ``role`` under ``cfg``, with the row
        weights of its mean."""
        if role not in self.losses:
            raise UserError(f"{self.name} trains no {role!r} model; it trains "
                            f"{', '.join(self.losses)}", field="algorithm.name")
        if not isinstance(cfg, self.config):
            raise TypeError(f"{self.name} needs a {self.config.__name__}, got "
                            f"{type(cfg).__name__}")
        return TrainLoss(self.losses[role](cfg), self.normalisers[role](cfg))

    def actor_loss_fn(self, cfg: AlgorithmParams) -> TrainLoss:
        return self.loss_fn("actor", cfg)

    def critic_loss_fn(self, cfg: AlgorithmParams) -> TrainLoss:
        return self.loss_fn("critic", cfg)


def _table(*algorithms: Algorithm[Any]) -> Mapping[str, Algorithm[Any]]:
    table: dict[str, Algorithm[Any]] = {}
    for a in algorithms:
        if a.name in table:
            raise ValueError(f"algorithm {a.name!r} registered twice")
        if a.name not in SPECS:
            raise ValueError(f"algorithm {a.name!r} has no torch-free half in "
                             "planner.graph.algorithms")
        table[a.name] = a
    return MappingProxyType(table)


# what each loss's mean is over (TrainLoss.weights)
def _rows(cfg: AlgorithmParams) -> RowWeights:
    """A mean over rows or pairs, or a loss already normalised by the mini-batch's
    totals and scaled by its rows (DAPO's minibatch_token_mean, Dr. GRPO's constant)."""
    return per_row


def _response_tokens(cfg: AlgorithmParams) -> RowWeights:
    """A token mean over the response tokens (:func:`batch_mask`)."""
    return aggregate_weights("token_mean", batch_mask)


def _response_sequences(cfg: AlgorithmParams) -> RowWeights:
    """A mean over the sequences that have response tokens (GSPO)."""
    return aggregate_weights("seq_mean_token_mean", batch_mask)


def _response_agg(cfg: AlgorithmParams) -> RowWeights:
    """``cfg.loss_agg`` over the response tokens (GRPO)."""
    assert isinstance(cfg, GRPOConfig)
    return aggregate_weights(cfg.loss_agg, batch_mask)


def _loss_mask_agg(cfg: AlgorithmParams) -> RowWeights:
    """``cfg.loss_agg`` over the batch's ``loss_mask`` (SFT, rejection sampling)."""
    assert isinstance(cfg, (SFTConfig, RejectionSamplingConfig))
    return aggregate_weights(cfg.loss_agg, loss_mask_of)


ALGORITHMS: Mapping[str, Algorithm[Any]] = _table(
    Algorithm("ppo", ppo.PPOConfig, ppo.prepare,
              {"actor": ppo.actor_loss_fn, "critic": ppo.critic_loss_fn},
              {"actor": _response_tokens, "critic": _response_tokens}),
    Algorithm("grpo", grpo.GRPOConfig, grpo.prepare, {"actor": grpo.actor_loss_fn},
              {"actor": _response_agg}),
    Algorithm("remax", remax.ReMaxConfig, remax.prepare, {"actor": remax.actor_loss_fn},
              {"actor": _response_tokens}),
    Algorithm("reinforce_pp", reinforce_pp.ReinforcePPConfig, reinforce_pp.prepare,
              {"actor": reinforce_pp.actor_loss_fn}, {"actor": _response_tokens}),
    Algorithm("rloo", rloo.RLOOConfig, rloo.prepare, {"actor": rloo.actor_loss_fn},
              {"actor": _response_tokens}),
    Algorithm("dpo", dpo.DPOConfig, dpo.prepare, {"actor": dpo.actor_loss_fn},
              {"actor": _rows}),
    Algorithm("sft", sft.SFTConfig, sft.prepare, {"actor": sft.actor_loss_fn},
              {"actor": _loss_mask_agg}),
    Algorithm("rm", rm.RMConfig, rm.prepare, {"reward": rm.reward_loss_fn},
              {"reward": _rows}),
    Algorithm("rejection_sampling", rejection_sampling.RejectionSamplingConfig,
              rejection_sampling.prepare, {"actor": rejection_sampling.actor_loss_fn},
              {"actor": _loss_mask_agg}),
    Algorithm("online_dpo", online_dpo.OnlineDPOConfig, online_dpo.prepare,
              {"actor": online_dpo.actor_loss_fn}, {"actor": _rows}),
    Algorithm("dapo", dapo.DAPOConfig, dapo.prepare, {"actor": dapo.actor_loss_fn},
              {"actor": _rows}),
    Algorithm("gspo", gspo.GSPOConfig, grpo.prepare,     # GRPO's group advantages
              {"actor": gspo.actor_loss_fn}, {"actor": _response_sequences}),
    Algorithm("dr_grpo", dr_grpo.DrGRPOConfig, dr_grpo.prepare, {"actor": dr_grpo.actor_loss_fn},
              {"actor": _rows}),
)

def get(name: str) -> Algorithm[Any]:
    """The algorithm called ``name``; :class:`UserError` listing the known ones if none."""
    if name not in ALGORITHMS:
        raise UserError(f"unknown algorithm {name!r}; allowed: {', '.join(ALGORITHMS)}",
                        field="algorithm.name")
    return ALGORITHMS[name]
