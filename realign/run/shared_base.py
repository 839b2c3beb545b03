"""Which frozen roles an experiment scores as a LoRA model's base (adapters off).

A LoRA model keeps its checkpoint frozen and trains adapters on it (and a value head).
Two frozen roles are, by PPO's usual set-up, that very checkpoint:

* the reference (``models.ref``) is the actor's starting checkpoint: the actor with its
  adapters off computes exactly the reference's log-probs;
* the reward model (``models.reward``) is the critic's starting checkpoint, value head
  included: the critic's body with its adapters off and the checkpoint's head (kept,
  frozen, beside the head the critic trains) computes exactly the reward model's scores.

:func:`shared_bases` names the pairs an experiment shares (the same checkpoint: one
preset name, or one folder; the owner has LoRA;
``lora.<owner>.share_base`` is on; the borrower is not trained), and
:func:`planner.graph.shared_base.share_base` rewrites the graph so.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from planner.graph.dataflow import DataflowGraph
from planner.graph.shared_base import share_base
from realign.config.experiment import ExperimentConfig

#: (frozen role, the LoRA role whose base it may be)
PAIRS: tuple[tuple[str, Literal["actor", "critic"]], ...] = (("ref", "actor"), ("reward", "critic"))


def same_checkpoint(a: str, b: str) -> bool:
    """Whether two ``models.<role>`` values name one checkpoint: equal strings (a preset
    or the same path), or paths that resolve to one folder (a config.json file stands
    for its folder; links and ``..`` followed).

    ``("/abs/experiments/../runs/sft/final/actor", "/abs/runs/sft/final/actor/config.json")``:
    True."""
    if a == b:
        return True

    def where(ref: str) -> Path:
        p = Path(ref)
        return (p.parent if p.name == "config.json" else p).resolve()
    return where(a) == where(b)


def shared_bases(cfg: ExperimentConfig, trained: set[str]) -> dict[str, str]:
    """Frozen role -> the LoRA role that scores it with its adapters off, for the
    experiment whose graph trains ``trained`` (a trained borrower shares nothing)."""
    models = cfg.models.roles()
    out: dict[str, str] = {}
    for borrower, owner in PAIRS:
        lora = cfg.lora.get(owner)
        if (lora is None or not lora.share_base or borrower not in models
                or owner not in models or borrower in trained or owner not in trained):
            continue
        if same_checkpoint(models[borrower], models[owner]):
            out[borrower] = owner
    return out


def with_shared_bases(graph: DataflowGraph, cfg: ExperimentConfig) -> DataflowGraph:
    """``graph`` with every shared frozen role's calls made its owner's, adapters off."""
    trained = graph.trainable_roles()
    for borrower, owner in shared_bases(cfg, trained).items():
        graph = share_base(graph, borrower, owner)
    return graph
