"""A wall-clock bound on planning (``plan.time_limit_s``), set-up included.

The search passes one :class:`Deadline` to every phase that can take long on a big
cluster (pricing the candidates, the hand-written heuristics, branch and bound, the
annealer, the suggestion of a cluster that fits); each phase checks it between units
of work. Only the clock is read: the search stays free of I/O.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from planner.errors import PlanError


@dataclass(frozen=True)
class Deadline:
    """``end``: a ``time.perf_counter()`` value; ``limit_s``: the setting it came from."""

    end: float
    limit_s: float

    @staticmethod
    def after(limit_s: float) -> "Deadline":
        return Deadline(time.perf_counter() + limit_s, limit_s)

    def left_s(self) -> float:
        return self.end - time.perf_counter()

    def passed(self) -> bool:
        return time.perf_counter() >= self.end

    def check(self, what: str) -> None:
        """Raise a :class:`PlanError` naming ``plan.time_limit_s`` once it has passed."""
        if self.passed():
            raise PlanError(f"planning ran past plan.time_limit_s = {self.limit_s:g} s while "
                            f"{what}; allow more time (plan.time_limit_s, --time-limit) or "
                            "plan for fewer nodes", field="plan.time_limit_s")
