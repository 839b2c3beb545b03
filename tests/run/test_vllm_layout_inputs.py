"""vLLM at the plan's layout, refused where it still cannot run, before any worker
starts (exit code 2, the setting named, no traceback): a generate call on vLLM at
pp 2, and on the cpu device a TP wider than the cores realign may use (each vLLM CPU
worker is bound to cores of its own) and a mixture of experts whose per-TP-rank expert
width is not a multiple of 32. Nothing here needs vLLM installed."""
from __future__ import annotations

import pytest

from tests.run.conftest import experiment

pytestmark = pytest.mark.torch

ONE = {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"tp": 2, "pp": 1, "dp": 1}}


def _run(assets, tmp, capsys, generate_layout, actor="tiny/small_actor"):
    from realign.cli.main import main

    manual = {"actor.generate": {"mesh": ONE["mesh"], "layout": generate_layout},
              "actor.prox_inference": ONE, "actor.train": ONE}
    exp = experiment(assets, "tiny-grpo-cpu", tmp, run__steps=1, rollout__engine="vllm",
                     models__actor=actor, plan__manual=manual)
    code = main(["run", str(exp), "--run-dir", str(tmp / "run")])
    return code, capsys.readouterr().err


def test_vllm_at_pp2_is_refused_naming_the_call(tiny_assets, tmp_path, capsys, monkeypatch):
    import realign.run.vllm_check as check

    monkeypatch.setattr(check, "vllm_installed", lambda: True)
    code, err = _run(tiny_assets, tmp_path, capsys, {"tp": 1, "pp": 2, "dp": 1})
    assert code == 2, err
    assert "plan.manual.actor.generate" in err and "pp 1" in err
    assert "Traceback" not in err and not (tmp_path / "run" / "logs").exists()


def test_vllm_tp_above_the_cores_is_refused_on_cpu(tiny_assets, tmp_path, capsys,
                                                    monkeypatch):
    import os

    import realign.run.vllm_check as check

    monkeypatch.setattr(check, "vllm_installed", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    code, err = _run(tiny_assets, tmp_path, capsys, {"tp": 2, "pp": 1, "dp": 1})
    assert code == 2, err
    assert "plan.manual.actor.generate" in err and "at tp 2" in err and "use 1" in err
    assert "Traceback" not in err and not (tmp_path / "run" / "logs").exists()


def test_vllm_moe_experts_padded_on_cpu_are_refused(tiny_assets, tmp_path, capsys,
                                                     monkeypatch):
    import os

    import realign.run.vllm_check as check
    from realign.assets.tiny_cmd import make_moe_actor

    if not (tiny_assets / "tiny" / "moe_actor").is_dir():
        make_moe_actor(tiny_assets / "tiny")
    monkeypatch.setattr(check, "vllm_installed", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    # the tiny MoE's experts of 32 at tp 2: 16 per TP rank
    code, err = _run(tiny_assets, tmp_path, capsys, {"tp": 2, "pp": 1, "dp": 1},
                     actor="tiny/moe_actor")
    assert code == 2, err
    assert "plan.manual.actor.generate" in err and "16 per TP rank" in err
    assert "tp 1 in plan.manual" in err
    assert "Traceback" not in err and not (tmp_path / "run" / "logs").exists()


def test_cpu_tp_problem_by_hand():
    from realign.config.experiment import ExperimentConfig
    from realign.run.vllm_check import cpu_tp_problem

    cfg = ExperimentConfig.model_validate({
        "name": "g", "models": {"actor": "llama2-7b"}, "device": "cpu",
        "algorithm": {"name": "grpo", "prompts_per_step": 2, "samples_per_prompt": 2,
                      "prompt_len": 8, "gen_len": 8},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "device": "cpu"}})
    assert cpu_tp_problem(cfg, "actor.generate", 2, 2) is None
    p = cpu_tp_problem(cfg, "actor.generate", 4, 2)
    assert p is not None and p.field == "plan.manual.actor.generate"
    gpu = cfg.model_copy(update={"device": "cuda"})
    assert cpu_tp_problem(gpu, "actor.generate", 8, 2) is None


def test_cpu_moe_problem_by_hand():
    from planner.specs.model_spec import ModelSpec, MoeSpec
    from realign.config.experiment import ExperimentConfig
    from realign.run.vllm_check import cpu_moe_problem

    cfg = ExperimentConfig.model_validate({
        "name": "g", "models": {"actor": "llama2-7b"}, "device": "cpu",
        "algorithm": {"name": "grpo", "prompts_per_step": 2, "samples_per_prompt": 2,
                      "prompt_len": 8, "gen_len": 8},
        "cluster": {"nodes": 1, "gpus_per_node": 4, "device": "cpu"}})

    def moe(width: int) -> ModelSpec:
        return ModelSpec(name="toy-moe", family="qwen3_moe", n_layers=2, hidden=64,
                         n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=128,
                         qk_norm=True,
                         moe=MoeSpec(n_experts=8, top_k=2, expert_ffn_hidden=width))

    assert cpu_moe_problem(cfg, moe(64), "actor.generate", 1) is None
    assert cpu_moe_problem(cfg, moe(64), "actor.generate", 2) is None
    p = cpu_moe_problem(cfg, moe(64), "actor.generate", 4)      # 16 per TP rank
    assert p is not None and p.field == "plan.manual.actor.generate"
    assert "16 per TP rank" in str(p) and "tp 1 or 2" in str(p) and "multiple of 32" in str(p)
    p = cpu_moe_problem(cfg, moe(48), "actor.generate", 1)       # no TP fits
    assert p is not None and p.field == "models.actor" and "multiple of 32" in str(p)
    gpu = cfg.model_copy(update={"device": "cuda"})
    assert cpu_moe_problem(gpu, moe(64), "actor.generate", 4) is None
    dense = moe(64).model_copy(update={"moe": None})
    assert cpu_moe_problem(cfg, dense, "actor.generate", 4) is None
