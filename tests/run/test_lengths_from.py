"""plan.lengths_from: generation priced with the response lengths a previous run
recorded, and a clear error for a folder that recorded none."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.errors import PlanError
from realign.run.loading import load_experiment
from realign.run.planning import experiment_graph, plan_experiment, resolve_models

pytestmark = pytest.mark.pure

EXP = Path(__file__).resolve().parents[2] / "experiments" / "ppo-llama2-7b-8gpu.yaml"


def config(lengths_from):
    cfg = load_experiment(EXP)
    plan = cfg.plan.model_copy(update={"lengths_from": lengths_from, "time_limit_s": 5.0,
                                       "anneal_steps": 3000})
    return cfg.model_copy(update={"plan": plan})


def run_folder(tmp_path: Path, rows: list[dict]) -> Path:
    d = tmp_path / "run"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_recorded_lengths_price_generation_below_the_cap(tmp_path):
    cfg = config(None)
    gen_len = cfg.algorithm.gen_len
    folder = run_folder(tmp_path, [{"step": 0, "response_len": gen_len / 8},
                                   {"step": 1, "response_len": gen_len / 4},
                                   {"step": 2, "loss": 1.0}])
    cfg2 = config(str(folder))
    models = resolve_models(cfg2)
    gen = next(m for m in experiment_graph(cfg2, models).mfcs if m.kind == "generate")
    assert gen.lengths.max_len == gen_len
    assert gen.lengths.mean == pytest.approx((gen_len / 8 + gen_len / 4) / 2)
    capped = plan_experiment(cfg).allocation("actor.generate").time_s
    recorded = plan_experiment(cfg2).allocation("actor.generate").time_s
    assert recorded < capped        # shorter responses: fewer decode steps per wave


def test_recorded_histograms_are_pooled_and_capped(tmp_path):
    cfg = config(None)
    gen_len = cfg.algorithm.gen_len
    folder = run_folder(tmp_path, [
        {"step": 0, "response_len": 10.0, "response_len_hist": [[5, 2], [gen_len, 1]]},
        {"step": 1, "response_len": 10.0, "response_len_hist": [[5, 1], [gen_len + 7, 3]]},
        {"step": 2, "loss": 1.0}])
    cfg2 = config(str(folder))
    gen = next(m for m in experiment_graph(cfg2, resolve_models(cfg2)).mfcs
               if m.kind == "generate")
    # every response counts (not the steps' means); past the cap: at the cap
    assert gen.lengths.mean is None
    assert gen.lengths.histogram == ((5, 3.0), (gen_len, 4.0))
    pmf = gen.lengths.pmf()
    assert pmf[4] == pytest.approx(3 / 7) and pmf[gen_len - 1] == pytest.approx(4 / 7)
    # the same mean as a censored geometric (a fixed stop chance per token) puts less
    # at the cap than these bimodal recorded lengths
    by_mean = config(str(run_folder(tmp_path / "m", [{"response_len": sum(
        x * w for x, w in gen.lengths.histogram) / 7}])))
    m2 = next(m for m in experiment_graph(by_mean, resolve_models(by_mean)).mfcs
              if m.kind == "generate")
    assert m2.lengths.pmf()[gen_len - 1] < 0.35 < 0.5 < pmf[gen_len - 1]


def test_a_malformed_histogram_names_the_setting(tmp_path):
    folder = run_folder(tmp_path, [{"response_len": 3.0, "response_len_hist": [[3, "x"]]}])
    cfg = config(str(folder))
    with pytest.raises(PlanError, match="response_len_hist must be") as e:
        experiment_graph(cfg, resolve_models(cfg))
    assert e.value.field == "plan.lengths_from"


def test_the_metrics_file_itself_may_be_named(tmp_path):
    folder = run_folder(tmp_path, [{"response_len": 10.0}])
    cfg = config(str(folder / "metrics.jsonl"))
    gen = next(m for m in experiment_graph(cfg, resolve_models(cfg)).mfcs
               if m.kind == "generate")
    assert gen.lengths.mean == 10.0


@pytest.mark.parametrize("rows,says", [
    (None, "no metrics.jsonl"),
    ([{"loss": 1.0}], "records no response_len"),
])
def test_a_folder_without_lengths_names_the_setting(tmp_path, rows, says):
    where = run_folder(tmp_path, rows) if rows is not None else tmp_path / "nothing"
    cfg = config(str(where))
    with pytest.raises(PlanError, match=says) as e:
        experiment_graph(cfg, resolve_models(cfg))
    assert e.value.field == "plan.lengths_from"


@pytest.mark.parametrize("sizes", [[30, None], [-29], [30, 2.5], [True], "30", 30])
def test_a_bad_round_prompts_row_names_the_setting_and_the_line(tmp_path, sizes):
    from realign.run.lengths import recorded_drop_frac

    folder = run_folder(tmp_path, [
        {"step": 0, "response_len": 3.0, "actor.dropped_group_frac": 0.5,
         "actor.round_prompts": [30, 20]},
        {"step": 1, "response_len": 3.0, "actor.dropped_group_frac": 0.8,
         "actor.round_prompts": sizes}])
    with pytest.raises(PlanError, match="line 2: actor.round_prompts must be a list") as e:
        recorded_drop_frac(config(str(folder)))
    assert e.value.field == "plan.lengths_from"


def test_round_prompts_weigh_each_step_by_the_prompts_it_generated(tmp_path):
    from realign.run.lengths import recorded_drop_frac

    folder = run_folder(tmp_path, [
        {"step": 0, "actor.dropped_group_frac": 0.5, "actor.round_prompts": [30, 20]},
        {"step": 1, "actor.dropped_group_frac": 0.2, "actor.round_prompts": [0, 0]},
        {"step": 2, "actor.dropped_group_frac": 0.1},                  # one round: 1
        {"step": 3, "actor.dropped_group_frac": 0.9, "actor.round_prompts": [30]}])
    assert recorded_drop_frac(config(str(folder))) == pytest.approx(
        (0.5 * 50 + 0.1 * 1 + 0.9 * 30) / 81)
