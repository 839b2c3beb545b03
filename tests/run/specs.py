"""Prepared runs without weights or processes, for pure tests: the shipped tiny
experiment's config, planned on a preset model."""
from __future__ import annotations

from pathlib import Path

import yaml

from realign.config.experiment import ExperimentConfig
from realign.paths import YAML_DIR
from realign.run.planning import plan_experiment
from realign.run.spec import RunSpec

REPO = Path(__file__).resolve().parents[2]


def planned_spec(run_dir: Path, name: str = "tiny-grpo-cpu", **changes) -> RunSpec:
    """A :class:`RunSpec` of ``experiments/<name>.yaml`` with every model role on the
    ``tiny-llama`` preset; ``changes``: top-level sections to replace."""
    raw = yaml.safe_load((REPO / "experiments" / f"{name}.yaml").read_text())
    raw["models"] = {role: "tiny-llama" for role in raw["models"]}
    raw.update(changes)
    cfg = ExperimentConfig.model_validate(raw, context={YAML_DIR: REPO / "experiments"})
    plan = plan_experiment(cfg)
    return RunSpec(config=cfg, plan=plan, paths={r: REPO / "x" / r for r in raw["models"]},
                   run_dir=run_dir,
                   tokenizer_role=cfg.tokenizer_role(), reward_fn=cfg.rule_reward_fn(),
                   verifier=None, eval_prompts=None)
