"""``rollout.mode: streaming`` at run time: planned, not executed.

The experiment schema accepts a streaming experiment whose combination the streaming
schedule covers (:func:`realign.config.streaming.check_streaming` refuses the others),
and ``realign plan`` plans it (the split, the schedule and its predicted steady state:
``plan.streaming``). No runtime runs that schedule, so ``realign run``, ``realign
submit`` and ``realign bench`` refuse it while they prepare the run, before any worker
starts (exit 2), naming ``rollout.mode``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from realign.errors import UserError

if TYPE_CHECKING:
    from realign.config.experiment import ExperimentConfig


def check_streaming_runs(cfg: ExperimentConfig) -> None:
    """Refuse to run ``rollout.mode: streaming`` (its plan is made, its schedule is not
    executed by any runtime)."""
    if cfg.rollout.mode != "streaming":
        return
    raise UserError(
        "rollout.mode: streaming is not executed yet: realign plan plans it (the split of "
        "the GPUs, the rollout buffer's schedule and its predicted steady state: "
        "plan.streaming), but no runtime runs it (docs/async.md); use rollout.mode: step, "
        "which generates one step ahead with algorithm.max_staleness >= 1",
        field="rollout.mode")
