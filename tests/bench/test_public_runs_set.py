"""The shipped calibration set of ``realign bench public`` (benchmarks/public_runs): every
run is sourced and quoted, and its experiment YAML loads and plans on the device preset
its hardware names."""
from __future__ import annotations

import pytest

from realign.bench.public import DEFAULT_INDEX, load_index

pytestmark = pytest.mark.pure

PRESET_OF = {"A100": "a100-80g", "H100": "h100-80g", "H200": "h200"}


def test_every_run_is_sourced_and_its_setting_loads():
    """Each run quotes its figure and names its source; its experiment file exists, loads,
    carries the run's id as its name and is priced with the preset its hardware names (an
    entry on 'H100' plans with h100-80g); published phases fit in the step; the set holds
    at least two H100 runs and runs from at least five systems."""
    from realign.run.loading import load_experiment

    idx = load_index(DEFAULT_INDEX)
    on_device: dict[str, int] = {}
    for r in idx.runs:
        assert r.source.strip() and r.quote.strip(), r.id
        path = DEFAULT_INDEX.parent / r.experiment
        assert path.is_file(), f"{r.id}: no experiment file {path}"
        cfg = load_experiment(path)
        assert cfg.name == r.id, f"{r.id}: the experiment is named {cfg.name}"
        device = cfg.cluster.spec().device.name
        named = [preset for gpu, preset in PRESET_OF.items() if gpu in r.hardware]
        assert named == [device], f"{r.id}: hardware {r.hardware!r} planned on {device}"
        on_device[device] = on_device.get(device, 0) + 1
        phases = [v for k, v in r.measured.model_dump().items() if k != "step_s" and v]
        assert sum(phases) <= r.measured.step_s * 1.01, f"{r.id}: phases exceed the step"
    assert on_device.get("h100-80g", 0) >= 2
    assert len({r.system for r in idx.runs}) >= 5


def _valid_count(count: int, manual: dict, plan, models: dict) -> bool:
    """Whether every call of ``manual`` may run in ``count`` micro-batches (its
    sequences per replica split into them)."""
    from planner.specs.layout import layout_problems

    return all(not layout_problems(a.layout, a.mesh, models[mfc.role].spec, mfc, count,
                                   plan.cluster)
               for name, a in manual.items() for mfc in [plan.graph.mfc(name)])


def test_a_largest_batch_placement_is_the_fewest_micro_batches_that_fit() -> None:
    """A DeepSpeed-Chat run's batch per rank is the largest that fits (its benchmark's
    rule), so its ``plan.manual`` takes the fewest micro-batches with which the run's
    placement fits realign's memory model: it plans with them, and with one fewer (the
    next valid count below: every call's sequences per replica split into it) it does
    not fit."""
    from planner.errors import PlanError
    from realign.run.loading import load_experiment
    from realign.run.plan_source import resolve_plan
    from realign.run.planning import priced_with, resolve_models

    checked = 0
    for r in load_index(DEFAULT_INDEX).runs:
        if r.system != "DeepSpeed-Chat":
            continue
        cfg = priced_with(load_experiment(DEFAULT_INDEX.parent / r.experiment), None)
        manual = cfg.plan.manual
        if not manual:
            continue
        m = {a.micro_batches for a in manual.values()}
        assert len(m) == 1, f"{r.id}: one batch per rank for every call"
        models = resolve_models(cfg)
        plan = resolve_plan(cfg, models)            # the fewest fit: it plans
        assert plan.iteration_time_s > 0
        assert {a.micro_batches for a in plan.allocations} == m
        (fewest,) = m
        fewer = next((c for c in range(fewest - 1, 0, -1)
                      if _valid_count(c, manual, plan, models)), None)
        if fewer is None:
            continue
        assert _valid_count(fewest, manual, plan, models)
        less = {k: a.model_copy(update={"micro_batches": fewer}) for k, a in manual.items()}
        smaller = cfg.model_copy(update={"plan": cfg.plan.model_copy(update={"manual": less})})
        with pytest.raises(PlanError, match="does not fit in memory"):
            resolve_plan(smaller, models)
        checked += 1
    assert checked >= 1, checked
