"""plan.lengths_from: generation priced with the response lengths a previous run
recorded, and a clear error for a folder that recorded none."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.errors import PlanError
from realign.config.loading import load_experiment
from realign.config.planning import experiment_graph, plan_experiment, resolve_models

pytestmark = pytest.mark.pure

EXP = Path(__file__).resolve().parents[2] / "experiments" / "ppo-llama2-7b-8gpu.yaml"


def config(lengths_from):
    cfg, base = load_experiment(EXP)
    plan = cfg.plan.model_copy(update={"lengths_from": lengths_from, "time_limit_s": 5.0,
                                       "anneal_steps": 3000})
    return cfg.model_copy(update={"plan": plan}), base


def run_folder(tmp_path: Path, rows: list[dict]) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_recorded_lengths_price_generation_below_the_cap(tmp_path):
    cfg, base = config(None)
    gen_len = cfg.algorithm.gen_len
    folder = run_folder(tmp_path, [{"step": 0, "response_len": gen_len / 8},
                                   {"step": 1, "response_len": gen_len / 4},
                                   {"step": 2, "loss": 1.0}])
    cfg2, _ = config(str(folder))
    models = resolve_models(cfg2, base)
    gen = next(m for m in experiment_graph(cfg2, models, base).mfcs if m.kind == "generate")
    assert gen.lengths.max_len == gen_len
    assert gen.lengths.mean == pytest.approx((gen_len / 8 + gen_len / 4) / 2)
    capped = plan_experiment(cfg, base).allocation("actor.generate").time_s
    recorded = plan_experiment(cfg2, base).allocation("actor.generate").time_s
    assert recorded < capped        # shorter responses: fewer decode steps per wave


def test_the_metrics_file_itself_may_be_named(tmp_path):
    folder = run_folder(tmp_path, [{"response_len": 10.0}])
    cfg, base = config(str(folder / "metrics.jsonl"))
    gen = next(m for m in experiment_graph(cfg, resolve_models(cfg, base), base).mfcs
               if m.kind == "generate")
    assert gen.lengths.mean == 10.0


@pytest.mark.parametrize("rows,says", [
    (None, "no metrics.jsonl"),
    ([{"loss": 1.0}], "records no response_len"),
])
def test_a_folder_without_lengths_names_the_setting(tmp_path, rows, says):
    where = run_folder(tmp_path, rows) if rows is not None else tmp_path / "nothing"
    cfg, base = config(str(where))
    with pytest.raises(PlanError, match=says) as e:
        experiment_graph(cfg, resolve_models(cfg, base), base)
    assert e.value.field == "plan.lengths_from"
