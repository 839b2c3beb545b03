"""Where a hyper-parameter is written and the error of two that contradict each other,
torch-free (:mod:`realign.algorithms.params` raises them; the pairs checked are listed in
docs/algorithms.md)."""
from __future__ import annotations

from typing import Any, Mapping

from planner.errors import UserError

#: what the batch shape sets (``algorithm.<its name>``), never ``algorithm.params``:
#: the name a user might write in params -> the batch shape's field
SHAPE_OWNED: Mapping[str, str] = {"samples_per_prompt": "samples_per_prompt",
                                  "prompts_per_step": "prompts_per_step",
                                  "gen_len": "gen_len",
                                  "dropped_group_frac": "dropped_group_frac",
                                  "ppo_epochs": "ppo_epochs", "minibatches": "ppo_minibatches",
                                  "ppo_minibatches": "ppo_minibatches"}


def param_path(name: str) -> str:
    """The experiment's path of hyper-parameter ``name``: ``algorithm.<field>`` for one
    the batch shape owns (:data:`SHAPE_OWNED`), else ``algorithm.params.<name>``."""
    return f"algorithm.{SHAPE_OWNED[name]}" if name in SHAPE_OWNED else f"algorithm.params.{name}"


def contradiction(name: str, value: Any, other: str, other_value: Any,
                  allowed: str) -> UserError:
    """The :class:`UserError` of two hyper-parameters that contradict each other: at
    ``name``'s path, naming both with their values, and what is allowed.

    >>> str(contradiction("clip_ratio_high", 0.2, "clip_ratio", 0.28, "high >= low"))
    'algorithm.params.clip_ratio_high: 0.2 contradicts algorithm.params.clip_ratio 0.28; allowed: high >= low'
    """
    return UserError(f"{value!r} contradicts {param_path(other)} {other_value!r}; allowed: "
                     f"{allowed}", field=param_path(name))
