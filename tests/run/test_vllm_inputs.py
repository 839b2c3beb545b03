"""rollout.engine in realign's own environment: what cannot run on vLLM is refused
before any worker starts (exit code 2, the setting named, no traceback), ``auto``
falls back to the own engine, and with the own engine the rollout's log-probs match
the training forward's (the mismatch the train call logs is fp32 rounding)."""
from __future__ import annotations

import json

import pytest

from tests.run.conftest import experiment
from tests.run.run_records import metrics


def _run(assets, tmp, capsys, **changes):
    from realign.cli.main import main

    changes.setdefault("run__steps", 1)
    exp = experiment(assets, "tiny-grpo-cpu", tmp, **changes)
    code = main(["run", str(exp), "--run-dir", str(tmp / "run")])
    return code, capsys.readouterr().err


@pytest.mark.torch
@pytest.mark.parametrize("installed,changes,says", [
    (False, {}, ("rollout.engine", "vLLM is not installed", "make vllm-env")),
    (True, {}, ("models.actor", "heads of 16 channels", "at least 32")),
    (True, {"models__actor": "tiny/small_actor", "rollout__vllm__kv_cache_gib": 1e-6},
     ("rollout.vllm.kv_cache_gib", "cannot hold one sequence of 12 tokens")),
])
def test_what_vllm_cannot_run_is_refused_before_any_worker(
        installed, changes, says, tiny_assets, tmp_path, capsys, monkeypatch):
    import realign.run.vllm_check as check

    monkeypatch.setattr(check, "vllm_installed", lambda: installed)
    code, err = _run(tiny_assets, tmp_path, capsys, rollout__engine="vllm", **changes)
    assert code == 2
    assert all(s in err for s in says), err
    assert "Traceback" not in err and not (tmp_path / "run" / "logs").exists()


@pytest.mark.torch
def test_auto_plans_the_own_engine_where_vllm_cannot_run(tiny_assets, tmp_path, capsys,
                                                         monkeypatch):
    import realign.run.vllm_check as check
    from realign.run.prepare import prepare

    monkeypatch.setattr(check, "vllm_installed", lambda: False)
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, rollout__engine="auto")
    spec = prepare(exp, run_dir=str(tmp_path / "run"))
    assert {a.engine for a in spec.plan.allocations} == {"own"}
    assert spec.config.rollout.engine == "own"
    assert "rollout.engine auto: vLLM cannot run here" in capsys.readouterr().err


@pytest.mark.cpu_dist
def test_own_engine_log_probs_match_training_and_tis_weights_are_one(tiny_assets, tmp_path,
                                                                     capsys):
    """With tis_cap the training forward scores the rollout (actor.prox_inference) and
    the loss is weighted by min(pi_train / pi_rollout, cap). realign's own engine
    computes the rollout's log-probs with the same decoder as training: they differ only
    by fp32 rounding (the decode step's cached attention against the whole-sequence
    pass), so the logged mismatch is below 1e-6 and no weight moves off 1."""
    code, err = _run(tiny_assets, tmp_path, capsys, run__steps=2,
                     algorithm__params__tis_cap=2.0)
    assert code == 0, err
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert [a["mfc"] for a in plan["allocations"]] == ["actor.generate",
                                                      "actor.prox_inference", "actor.train"]
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert 0 <= row["actor.rollout_logprob_diff_mean"] <= row["actor.rollout_logprob_diff_max"]
        assert row["actor.rollout_logprob_diff_max"] < 1e-6
        assert row["actor.rollout_logprob_diff_frac"] == 0.0
        assert row["actor.behave_weight"] == pytest.approx(1.0, abs=1e-5)
        assert row["actor.behave_weight_capped_frac"] == 0.0
