"""``realign bench public`` on two small entries: every ratio is the plan's per-call
estimates over the published figure, and the index is checked like user input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from realign.bench.public import (
    band,
    error_of,
    load_index,
    phase_estimates,
    run_public,
    select,
)
from realign.errors import UserError

pytestmark = pytest.mark.pure

PPO = {"name": "small-ppo", "models": {"actor": "qwen2.5-0.5b", "ref": "qwen2.5-0.5b",
                                       "critic": "qwen2.5-0.5b", "reward": "qwen2.5-0.5b"},
       "algorithm": {"name": "ppo", "prompts_per_step": 64, "prompt_len": 128, "gen_len": 128,
                     "ppo_minibatches": 2},
       "cluster": {"nodes": 1, "gpus_per_node": 4, "device": "a100-80g"},
       "plan": {"method": "auto", "time_limit_s": 20, "seed": 0}}
GRPO = {"name": "small-grpo", "models": {"actor": "qwen2.5-0.5b", "ref": "qwen2.5-0.5b"},
        "algorithm": {"name": "grpo", "prompts_per_step": 16, "samples_per_prompt": 4,
                      "prompt_len": 64, "gen_len": 256, "gen_len_mean": 100,
                      "ppo_minibatches": 1},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "device": "h100-80g"},
        "plan": {"method": "auto", "time_limit_s": 20, "seed": 0}}


def write_set(tmp_path: Path, ppo_step_s: float = 10.0, grpo_gen_s: float = 2.0) -> Path:
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump(PPO))
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(GRPO))
    runs = [{"id": "ppo", "system": "A", "experiment": "ppo.yaml", "hardware": "4 x A100",
             "source": "a table", "quote": "10 s", "measured": {"step_s": ppo_step_s}},
            {"id": "grpo", "system": "B", "experiment": "grpo.yaml", "hardware": "2 x H100",
             "source": "a log", "quote": "timing_s/step:5", "derived": None,
             "measured": {"step_s": 5.0, "generation_s": grpo_gen_s, "training_s": 1.5}}]
    p = tmp_path / "runs.yaml"
    p.write_text(yaml.safe_dump({"runs": runs}))
    return p


def test_ratios_come_from_the_plans_per_call_estimates(tmp_path):
    rec = run_public(write_set(tmp_path), time_limit_s=3.0)
    rows = {r["id"]: r for r in rec["runs"]}
    assert set(rows) == {"ppo", "grpo"} and not rec["summary"]["failed"]
    for r in rows.values():
        calls = r["estimate"]["calls"]
        by_kind = {k: sum(c["time_s"] for c in calls if c["kind"] == k)
                   for k in ("generate", "inference", "train")}
        assert by_kind["generate"] > 0 and by_kind["train"] > 0
        ph = r["estimate"]["phases"]
        assert ph["generation"] == pytest.approx(by_kind["generate"])
        assert ph["scoring"] == pytest.approx(by_kind["inference"])
        assert ph["training"] == pytest.approx(by_kind["train"])
        assert ph["weight_sync"] == pytest.approx(
            sum(x["time_s"] for x in r["estimate"]["reallocations"]))
        assert r["ratios"]["step"] == pytest.approx(
            r["estimate"]["step_s"] / r["measured"]["step_s"])
    assert set(rows["ppo"]["ratios"]) == {"step"}          # only what the source published
    g = rows["grpo"]
    assert set(g["ratios"]) == {"step", "generation", "training"}
    assert g["ratios"]["generation"] == pytest.approx(g["estimate"]["phases"]["generation"] / 2.0)
    assert g["ratios"]["training"] == pytest.approx(g["estimate"]["phases"]["training"] / 1.5)
    assert rows["ppo"]["device"] == "a100-80g" and g["device"] == "h100-80g"
    s = rec["summary"]
    assert s["all"]["n_runs"] == 2 and set(s["by_device"]) == {"a100-80g", "h100-80g"}
    steps = sorted(r["ratios"]["step"] for r in rows.values())
    assert s["all"]["median_ratio"] == pytest.approx(sum(steps) / 2)
    assert s["all"]["worst_ratio"] in steps
    assert s["by_phase"]["generation"]["n_runs"] == 1 and s["by_phase"]["scoring"] is None
    json.dumps(rec)                                        # the record is plain JSON


def test_phase_sums_of_a_plan_json():
    plan = {"allocations": [{"kind": "generate", "time_s": 3.0},
                            {"kind": "inference", "time_s": 0.5},
                            {"kind": "inference", "time_s": 0.25},
                            {"kind": "train", "time_s": 2.0}],
            "reallocations": [{"time_s": 0.1}, {"time_s": 0.05}]}
    assert phase_estimates(plan) == pytest.approx(
        {"generation": 3.0, "scoring": 0.75, "training": 2.0, "weight_sync": 0.15})


def test_error_is_symmetric_and_the_worst_is_the_farthest():
    assert error_of(0.5) == pytest.approx(1.0) and error_of(2.0) == pytest.approx(1.0)
    assert error_of(1.0) == 0.0
    b = band([0.8, 1.1, 0.25, 3.0])
    assert b["worst_ratio"] == 0.25 and b["worst_error_pct"] == pytest.approx(300.0)
    assert b["median_ratio"] == pytest.approx(0.95)
    # errors 0.25, 0.1, 3.0, 2.0: the median of those, not the error of the median ratio
    assert b["median_error_pct"] == pytest.approx(100 * (0.25 + 2.0) / 2)
    assert band([]) is None


def test_bad_index_and_ids_are_user_errors(tmp_path):
    p = write_set(tmp_path)
    idx = load_index(p)
    with pytest.raises(UserError) as e:
        select(idx, "ppo,nope")
    assert e.value.field == "--only" and "nope" in str(e.value)
    assert [r.id for r in select(idx, "grpo")] == ["grpo"]
    raw = yaml.safe_load(p.read_text())
    raw["runs"].append(dict(raw["runs"][0]))
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match="twice: ppo"):
        load_index(p)
    raw["runs"][0]["measured"]["step_s"] = -1
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError):
        load_index(p)
    with pytest.raises(UserError):
        load_index(tmp_path / "missing.yaml")


def test_committed_set_is_well_formed():
    """Every entry of the shipped set names an experiment that exists, quotes its figure
    and has a positive step time; at least two systems and both A100 and Hopper GPUs."""
    from realign.bench.public import DEFAULT_INDEX
    from realign.run.loading import load_experiment

    idx = load_index(DEFAULT_INDEX)
    devices = set()
    for r in idx.runs:
        cfg = load_experiment(DEFAULT_INDEX.parent / r.experiment)
        devices.add(cfg.cluster.spec().device.name)
        assert r.quote.strip() and r.source.strip() and r.measured.step_s > 0
    assert len({r.system for r in idx.runs}) >= 2
    assert "a100-80g" in devices and devices & {"h100-80g", "h200"}


def test_a_run_with_its_placement_is_priced_as_given(tmp_path):
    """A run whose source publishes its placement and micro-batches gives them as
    ``plan.manual``: the bench prices exactly those allocations, searching nothing."""
    whole = {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"dp": 2}}
    manual = {"actor.generate": whole, "ref.inference": {**whole, "micro_batches": 4},
              "actor.train": {**whole, "micro_batches": 8}}
    exp = json.loads(json.dumps(GRPO))
    exp["plan"]["manual"] = manual
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(exp))
    runs = [{"id": "grpo", "system": "B", "experiment": "grpo.yaml", "hardware": "2 x H100",
             "source": "a log", "quote": "5 s", "measured": {"step_s": 5.0}}]
    (tmp_path / "runs.yaml").write_text(yaml.safe_dump({"runs": runs}))
    row = run_public(tmp_path / "runs.yaml", time_limit_s=3.0)["runs"][0]
    assert row["search"]["method"] == "manual"
    got = {c["mfc"]: (c["layout"]["dp"], c["micro_batches"]) for c in row["estimate"]["calls"]}
    assert got == {k: (2, v.get("micro_batches", 1)) for k, v in manual.items()}
