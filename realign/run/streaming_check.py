"""``rollout.mode: streaming`` at run time: what the streaming runtime
(:mod:`realign.worker.stream_worker`) runs, checked while the run is prepared, before
any worker starts (exit 2, naming the field).

The experiment schema refuses the combinations the streaming schedule does not cover
(:func:`realign.config.streaming.check_streaming`: vLLM, multi-turn episodes, DAPO's
sampling rounds or reward model, a bound below 1, a plan.manual whose generation
shares GPUs with training).
Here, once the plan is made: its rollout must be one generate call on one GPU of its
own, filled by a reallocation from the trained copy, with every other call of a step
on the training side's GPUs (:func:`realign.run.stream_parts.stream_parts`); and the
own engine's streamed decode steps run eagerly (``rollout.capture: on`` is refused).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from realign.errors import UserError

if TYPE_CHECKING:
    from planner.plan import ExecutionPlan
    from realign.config.experiment import ExperimentConfig


def check_streaming_runs(cfg: ExperimentConfig) -> None:
    """Refuse what the streaming runtime does not run, from the config alone."""
    if cfg.rollout.mode != "streaming":
        return
    if cfg.rollout.capture == "on":
        raise UserError("rollout.capture is 'on', but rollout.mode: streaming decodes its "
                        "slots eagerly (their rows change every iteration); allowed: auto "
                        "or off", field="rollout.capture")


def check_streaming_plan(cfg: ExperimentConfig, plan: ExecutionPlan) -> None:
    """Refuse a plan whose placement the stream cannot run (UserError naming
    ``plan.manual.<call>``)."""
    if cfg.rollout.mode != "streaming":
        return
    from realign.run.program import compile_program
    from realign.run.stream_parts import stream_parts

    parts = stream_parts(compile_program(plan))
    st = plan.streaming
    if st is None:
        return
    a = cfg.algorithm
    where = cfg.plan.file or "the plan"
    field = "plan.file" if cfg.plan.file else "plan"
    group = parts.gen.mfc.n_seqs // a.shape().prompts_generated
    greedy = parts.greedy.mfc.n_seqs // a.prompts_per_step if parts.greedy is not None else 0
    want = {"group_size": group + greedy,
            "on_update": cfg.rollout.on_update}
    for name, value in want.items():
        if getattr(st, name) != value:
            raise UserError(f"{where}: streaming.{name} is {getattr(st, name)!r}, but the "
                            f"experiment's is {value!r}; plan again (realign plan)",
                            field=field)
    if st.max_staleness > a.max_staleness:       # the search may choose a tighter bound
        raise UserError(f"{where}: streaming.max_staleness is {st.max_staleness}, above the "
                        f"experiment's algorithm.max_staleness {a.max_staleness}; plan again "
                        "(realign plan)", field=field)
