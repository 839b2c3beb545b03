"""``realign run EXPERIMENT.yaml``: plan (or load a plan), check the data, start the
workers on this machine and train; resumes from the run folder's last checkpoint.

Everything that can be checked before a worker starts is checked here (models,
data, reward function, plan), so bad input exits with code 2 at once.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from realign.errors import UserError

RL = {"ppo", "grpo", "remax", "reinforce_pp", "rloo"}
DATA_KIND = {**{a: "prompts" for a in RL}, "dpo": "preferences", "rm": "preferences",
             "sft": "sft"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment YAML file")
    p.add_argument("--run-dir", help="run folder (overrides run.dir)")
    p.add_argument("--steps", type=int, help="override run.steps")


def prepare(args: argparse.Namespace):
    """Validate everything; return (RunSpec, experiment config)."""
    from realign.config.loading import load_experiment
    from realign.config.planning import resolve_models, resolve_plan
    from realign.controller.controller import RunSpec
    from realign.data.datasets import load_dataset
    from realign.data.tokenizer import load_tokenizer
    from realign.worker.session import algorithm_config

    cfg, base = load_experiment(args.experiment)
    if args.steps is not None:
        if args.steps <= 0:
            raise UserError(f"must be > 0 (got {args.steps})", field="--steps")
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"steps": args.steps})})
    launcher = getattr(args, "launcher", None)       # realign submit --launcher
    if launcher and launcher != cfg.launcher.type:
        from pydantic import TypeAdapter

        from realign.config.experiment import LauncherConfig
        try:
            chosen = TypeAdapter(LauncherConfig).validate_python({"type": launcher})
        except ValueError:
            raise UserError(f"unknown launcher {launcher!r}", field="--launcher") from None
        cfg = cfg.model_copy(update={"launcher": chosen})
    if cfg.data is None:
        raise UserError("realign run needs a data section with a train dataset", field="data")
    name = cfg.algorithm.name
    if cfg.data.train.kind != DATA_KIND[name]:
        raise UserError(f"{name} trains on {DATA_KIND[name]} data, the dataset is "
                        f"{cfg.data.train.kind!r}", field="data.train.kind")
    paths = {}
    for role, ref in cfg.models.roles().items():
        p = Path(ref) if Path(ref).is_absolute() else base / ref
        if not (p / "config.json").is_file():
            raise UserError(f"{ref!r} is not a Hugging Face checkpoint folder (no config.json "
                            "there); realign run needs weights, a preset name has none",
                            field=f"models.{role}")
        paths[role] = str(p.resolve())
    models = resolve_models(cfg, base)
    _, algo_cfg = algorithm_config(cfg)                    # hyper-parameters valid?
    kl_coef = getattr(algo_cfg, "kl_coef", 0.0)
    if name in RL and "ref" not in paths and kl_coef > 0:
        raise UserError(f"{name} with kl_coef {kl_coef} needs a reference model: set "
                        "models.ref, or algorithm.params.kl_coef: 0 to train without one",
                        field="models.ref")
    rule_reward = name in RL and "reward" not in paths
    if rule_reward:
        from realign.rewards.registry import load_reward_fn
        load_reward_fn(cfg.reward.fn if cfg.reward else "math_verify", base_dir=base)
    tok = load_tokenizer(paths.get("actor", paths.get("reward")))
    data = load_dataset(cfg.data.train, tok, base, field="data.train")
    too_long = [e for e in data.examples if len(e.prompt_ids) > cfg.algorithm.prompt_len]
    if too_long:
        e = too_long[0]
        raise UserError(f"{data.path} line {e.line}: the prompt has {len(e.prompt_ids)} tokens, "
                        f"more than algorithm.prompt_len = {cfg.algorithm.prompt_len}",
                        field="data.train")
    if cfg.device == "cpu" and cfg.cluster.device != "cpu":
        raise UserError("device 'cpu' needs cluster.device 'cpu' (the plan must be for the "
                        "machine that runs it)", field="cluster.device")
    plan = resolve_plan(cfg, base, models)
    run_dir = Path(args.run_dir or cfg.run.dir.format(name=cfg.name)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "plan.json").write_text(plan.to_json())
    from planner.timeline_svg import render
    (run_dir / "plan.svg").write_text(render(plan))          # reallocations show as bars
    (run_dir / "experiment.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=1))
    setup = {"config": cfg.model_dump(mode="json"), "plan": plan.to_json(),
             "paths": paths, "base": str(base), "rule_reward": rule_reward}
    spec = RunSpec(setup=setup, n_workers=plan.cluster.n_gpus, run_dir=run_dir,
                   steps=cfg.run.steps, checkpoint_interval=cfg.run.checkpoint_interval,
                   final_dir=run_dir / "final" / ("actor" if "actor" in paths else "reward"))
    spec.save()
    return spec, cfg, plan


def run(args: argparse.Namespace) -> int:
    from planner.report import table
    from realign.controller.controller import Controller
    from realign.launch.local import LocalLauncher

    spec, cfg, plan = prepare(args)
    print(table(plan))
    for r in plan.reallocations:
        print(f"the plan reallocates {r.role} each step ({r.src_layout} -> {r.dst_layout})")
    print(f"run folder: {spec.run_dir}", flush=True)
    launcher = LocalLauncher(threads_per_worker=cfg.launcher.threads_per_worker)
    return Controller(spec, launcher).run()
