"""The shape of a multi-turn generate call (``rollout.env`` / ``rollout.tools``): each
sequence is an episode of model turns and environment observations, so the call is
``turns`` generate calls over a growing context, in ``groups`` groups that take turns
while the environment answers (:mod:`realign.agents.rollout` runs exactly this).

How it is priced (:func:`planner.cost.turns.multi_turn_cost`): turn ``k`` (0-based) of
a group is a generate call of ``ceil(n / groups)`` sequences over a context of
``prompt_len + k * (tokens + obs_tokens)`` that generates ``tokens`` (the engine
prefills the whole context again each turn: it keeps no cache between calls), where
``tokens = min(turn_tokens, what is left of gen_len)``; a turn past the expected
``turns`` counts by its fraction (2.5 turns: the third at half weight). While one
group's environment steps run, the other ``groups - 1`` groups decode, so a turn waits
``max(0, env_s - (groups - 1) * group_turn_s)`` for its environment.
"""
from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field


class Turns(BaseModel):
    """A generate call's episodes: turns, tokens per turn, observations, environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    turns: float = Field(gt=0, description="Model turns per episode (expected).")
    turn_tokens: int = Field(gt=0, description="The most tokens of one model turn.")
    obs_tokens: int = Field(ge=0, description="Tokens of one observation.")
    env_s: float = Field(0.0, ge=0, description="Environment seconds per turn of a group "
                         "(its steps run concurrently: about one call's wall time).")
    groups: int = Field(1, ge=1, description="Episode groups that take turns.")

    def turn_shapes(self, prompt_len: int, gen_len: int) -> list[tuple[float, int, int]]:
        """(weight, context tokens, new tokens) of each turn within the budget.

        >>> Turns(turns=2.5, turn_tokens=10, obs_tokens=4).turn_shapes(8, 40)
        [(1.0, 8, 10), (1.0, 22, 10), (0.5, 36, 4)]
        """
        out = []
        for k in range(math.ceil(self.turns)):
            context = prompt_len + k * (self.turn_tokens + self.obs_tokens)
            left = prompt_len + gen_len - context
            if left <= 0:
                break
            out.append((min(1.0, self.turns - k), context, min(self.turn_tokens, left)))
        return out
