"""How the plan search runs (the ``plan`` section's search settings of an experiment):
a schema of its own, below the search, so that the experiment's schema names it
without importing the search (:func:`planner.search.search.search` reads it)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SearchSettings(BaseModel):
    """How to search (the ``plan`` section of an experiment)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["auto", "exact", "anneal"] = Field(
        "auto", description="auto: exact when the space has at most exact_max_space plans.")
    time_limit_s: float = Field(20.0, gt=0, le=86400, description="Wall-clock cap on planning, "
                                "set-up included.")
    seed: int = Field(0, ge=0, description="Seed of the annealer's random numbers.")
    anneal_steps: int = Field(2_000_000, gt=0, description="Most annealing steps in all "
                              "(the walks usually converge well before).")
    anneal_start_steps: int = Field(5000, gt=0, description="Length of each seed's first "
                                    "annealing chain; each further chain is twice as long.")
    anneal_patience: int = Field(2, gt=0, description="Chains in a row that improve a walk's "
                                 "best by less than 0.5 % before the walk counts as converged.")
    anneal_random_starts: int = Field(2, ge=0, description="Walks from random plans beside "
                                      "those from the heuristics' plans.")
    anneal_restarts: int = Field(2, ge=0, description="Walks from the best plan so far (new "
                                 "random numbers each) that in a row find nothing better "
                                 "before the annealing stops.")
    exact_max_space: int = Field(100_000, gt=0, description="Largest space searched exactly under auto.")
    exact_max_nodes: int = Field(2_000_000, gt=0, description="Node budget of branch and bound.")
    n_iters: int = Field(3, gt=0, le=16, description="Iterations simulated per estimate.")
