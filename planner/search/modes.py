"""The execution modes side by side: the best synchronous, one-step-ahead and streaming
plans of one experiment, summarised as :class:`~planner.plan.ModeResult` rows, and the
one that runs: the mode the experiment asks for where it asks for one (``rollout.mode:
streaming``), else the fastest (the earlier mode on a tie: synchronous before
asynchronous)."""
from __future__ import annotations

from planner.plan import ExecutionPlan, ModeResult
from planner.search.stream_search import rollout_calls, train_side_s

#: the modes in the order they are listed (and preferred on a tie)
MODES = ("synchronous", "asynchronous", "streaming")


def _share(busy_s: float, step_s: float) -> float:
    return min(1.0, max(0.0, 1.0 - busy_s / step_s)) if step_s > 0 else 0.0


def mode_result(mode: str, plan: ExecutionPlan | None, chosen: bool) -> ModeResult:
    """One mode's row: its estimate, allocations, split, expected staleness and idle
    shares (a streaming plan's predicted ones; one step ahead: every sample one version
    old, each side idle for what its calls leave of the step)."""
    if plan is None:
        return ModeResult(mode=mode, iteration_time_s=None, chosen=False)
    base = dict(mode=mode, iteration_time_s=plan.iteration_time_s, chosen=chosen,
                slower_side_s=plan.slower_side_s,
                allocations={a.mfc: f"{a.mesh_name} {a.layout} x{a.micro_batches}mb"
                             for a in plan.allocations})
    st = plan.streaming
    if st is not None:
        return ModeResult(**base, gen_gpus=st.gen_gpus, staleness_mean=st.staleness_mean,
                          gen_idle_share=st.gen_idle_share,
                          train_idle_share=st.train_idle_share)
    if not plan.asynchronous:
        return ModeResult(**base)
    names = {m.name for m in rollout_calls(plan.graph)}
    train_side = [a.mesh.first_gpu for a in plan.allocations
                  if a.mfc not in names and not plan.graph.mfc(a.mfc).is_eval]
    gen_s = sum(a.time_s for a in plan.allocations if a.mfc in names) + sum(
        r.time_s for r in plan.reallocations if r.to_mfc in names)
    return ModeResult(**base, gen_gpus=min(train_side, default=plan.cluster.n_gpus),
                      staleness_mean=float(plan.graph.ahead_steps),
                      gen_idle_share=_share(gen_s, plan.iteration_time_s),
                      train_idle_share=_share(train_side_s(plan), plan.iteration_time_s))


def choose_mode(plans: dict[str, ExecutionPlan | None], run: str | None = None
                ) -> ExecutionPlan:
    """The plan of mode ``run`` where given (the experiment asks for it: a streaming
    experiment runs its stream, however the others compare), else the fastest of
    ``plans`` (mode -> its best plan, None where none fits; at least one is a plan),
    listing every mode given."""
    given = [m for m in MODES if m in plans]
    fits = [m for m in given if plans[m] is not None]
    assert fits and (run is None or run in fits), (fits, run)
    best = run if run is not None else min(
        fits, key=lambda m: (plans[m].iteration_time_s,  # type: ignore[union-attr]
                             given.index(m)))
    chosen = plans[best]
    assert chosen is not None
    rows = tuple(mode_result(m, plans[m], m == best) for m in given)
    return chosen.model_copy(update={"modes": rows})
