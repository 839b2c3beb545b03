"""The tiny MoE demo (experiments/demo-moe-sft.yaml, then demo-moe-grpo.yaml): make-tiny
writes its Qwen3-MoE actor, both stages plan, and each stage's first step runs with the
router's loss and the expert load in its metrics. The learning curve over seeds is
benchmarks/moe/README.md's (realign/bench/studies/moe_seeds.py); a whole run is too long for the
suite's two shared cores."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run.conftest import experiment
from tests.run.run_records import metrics

REALIGN = [sys.executable, "-m", "realign.cli.main"]


@pytest.fixture(scope="module")
def moe_assets(tiny_assets) -> Path:
    from realign.assets.tiny_cmd import make_moe_actor

    make_moe_actor(tiny_assets / "tiny", seed=0)
    return tiny_assets


@pytest.mark.torch
def test_make_moe_actor_writes_the_tiny_qwen3_moe(tmp_path):
    from realign.assets.tiny import TINY_QWEN3_MOE
    from realign.assets.tiny_cmd import make_moe_actor

    a, b = make_moe_actor(tmp_path / "a", seed=0), make_moe_actor(tmp_path / "b", seed=0)
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "mlp_only_layers", "router_aux_loss_coef"):
        assert cfg.get(key, cfg.get("num_local_experts")) == TINY_QWEN3_MOE[key], key
    assert (a / "tokenizer.json").exists()
    # a pure function of the seed: the same weights byte for byte
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.mark.cpu_dist
def test_the_moe_demo_first_steps_run(moe_assets, tmp_path):
    """One step of each stage as shipped (two CPU workers): SFT from the random MoE
    actor, then GRPO from SFT's final actor. Each logs the router's load-balancing loss
    and the expert load, evaluates the held-out problems, and runs the searched plan."""
    sft = experiment(moe_assets, "demo-moe-sft", tmp_path, run__steps=1)
    r = subprocess.run([*REALIGN, "run", str(sft), "--run-dir", str(tmp_path / "sft")],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    grpo = experiment(moe_assets, "demo-moe-grpo", tmp_path, run__steps=1,
                      models__actor=str(tmp_path / "sft" / "final" / "actor"))
    r = subprocess.run([*REALIGN, "run", str(grpo), "--run-dir", str(tmp_path / "grpo")],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    for stage in ("sft", "grpo"):
        (row,) = metrics(tmp_path / stage)
        # top 2 of 8 experts: 2 under uniform routing, more when unbalanced, 4 at worst
        assert 1.5 < row["actor.router_aux_loss"] < 8, row
        assert 1.0 <= row["actor.expert_load_max_over_mean"] <= row[
            "actor.expert_load_max_over_mean_worst"] <= 4.0
        assert 0.0 <= row["eval.greedy_accuracy"] <= 1.0
        plan = json.loads((tmp_path / stage / "plan.json").read_text())
        assert {a["mfc"] for a in plan["allocations"]} >= {"actor.train", "actor.eval_greedy"}
        assert all(a["mesh"]["n_gpus"] <= 2 for a in plan["allocations"])
        # GRPO ran its calls at DP2·EP2 (plan.manual), SFT at the search's EP 1
        assert {a["layout"]["ep"] for a in plan["allocations"]} == {2 if stage == "grpo" else 1}
    assert metrics(tmp_path / "sft")[0]["eval.greedy_accuracy"] <= 0.1     # random: near 0
    assert 0.0 <= metrics(tmp_path / "grpo")[0]["reward_mean"] <= 1.0
    # GRPO started from SFT's weights, not make-tiny's
    cfg = json.loads((tmp_path / "grpo" / "final" / "actor" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"


@pytest.mark.pure
@pytest.mark.parametrize("name", ["demo-moe-sft", "demo-moe-grpo"])
def test_the_moe_demo_plans(moe_assets, tmp_path, name, capsys):
    """`realign plan` of both stages: every call on the two CPU workers."""
    from realign.cli.main import main

    changes = {}
    if name == "demo-moe-grpo":
        changes["models__actor"] = "tiny/moe_actor"
    exp = experiment(moe_assets, name, tmp_path, **changes)
    assert main(["plan", str(exp), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["iteration_time_s"] > 0
    for m in s["mfcs"]:
        assert m["tp"] * m["pp"] * m["dp"] == m["n_gpus"] <= 2



@pytest.mark.pure
def test_the_moe_grpo_stage_runs_every_call_at_dp2_ep2(moe_assets, tmp_path):
    """The plan ``realign run`` executes for the GRPO stage as shipped: its
    ``plan.manual`` places every call of the graph at DP2·EP2 on the two CPU workers,
    each holding half the experts (less expert memory a worker than at EP 1)."""
    from realign.run.loading import load_experiment
    from realign.run.plan_source import resolve_plan
    from realign.run.planning import resolve_models

    exp = experiment(moe_assets, "demo-moe-grpo", tmp_path, models__actor="tiny/moe_actor")
    cfg = load_experiment(exp)
    models = resolve_models(cfg)
    plan = resolve_plan(cfg, models)
    assert {a.mfc for a in plan.allocations} == {
        "actor.generate", "actor.train", "actor.eval_greedy", "actor.eval_sample"}
    for a in plan.allocations:
        assert (a.mesh.first_gpu, a.mesh.n_gpus) == (0, 2), a
        assert (a.layout.tp, a.layout.pp, a.layout.dp, a.layout.ep) == (1, 1, 2, 2), a
    ep1 = {k: v.model_copy(update={"layout": v.layout.model_copy(update={"ep": 1})})
           for k, v in (cfg.plan.manual or {}).items()}
    plan1 = resolve_plan(cfg.model_copy(update={"plan": cfg.plan.model_copy(
        update={"manual": ep1})}), models)
    assert max(plan.peak_mem_bytes) < max(plan1.peak_mem_bytes)
