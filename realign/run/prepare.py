"""prepare(): from an experiment YAML to a prepared run folder.

Everything that can be checked before a worker starts is checked here (the config,
the algorithm's hyper-parameters and data, the models, the reward function, the
plan), so bad input is a :class:`~realign.errors.UserError` (exit code 2) before any
process starts. Then the plan (searched, loaded or written by hand) and the
:class:`~realign.run.spec.RunSpec` go into the run folder: ``plan.json``, its timeline
``plan.svg``, ``experiment.json`` and ``run_spec.json``. ``realign run``, ``realign
submit`` (every back end) and ``realign bench`` all prepare through it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from planner.errors import from_validation
from realign.errors import UserError
from realign.run.checkpoint import save_file
from realign.run.spec import RunSpec

if TYPE_CHECKING:
    from realign.config.experiment import ExperimentConfig
    from realign.data.datasets import Dataset


def _with_overrides(cfg: ExperimentConfig, steps: int | None, launcher: str | None,
                    plan_file: Path | None = None) -> ExperimentConfig:
    """The config with ``--steps``, ``--launcher`` and a saved plan to run applied
    (validated alike)."""
    if plan_file is not None:
        cfg = cfg.model_copy(update={"plan": cfg.plan.model_copy(
            update={"file": str(Path(plan_file).resolve()), "manual": None})})
    if steps is not None:           # bounded exactly as run.steps is in the YAML
        from pydantic import ValidationError

        from realign.config.experiment import RunConfig
        try:
            run = RunConfig.model_validate({**cfg.run.model_dump(), "steps": steps})
        except ValidationError as e:
            raise from_validation(e, RunConfig, renames={"steps": "--steps"}) from None
        cfg = cfg.model_copy(update={"run": run})
    if launcher and launcher != cfg.launcher.type:
        from pydantic import TypeAdapter

        from realign.config.experiment import LauncherConfig
        try:
            chosen = TypeAdapter(LauncherConfig).validate_python({"type": launcher})
        except ValueError:
            raise UserError(f"unknown launcher {launcher!r}", field="--launcher") from None
        cfg = cfg.model_copy(update={"launcher": chosen})
    return cfg


def _checkpoint_folders(cfg: ExperimentConfig) -> dict[str, Path]:
    """Model role -> its Hugging Face checkpoint folder (a preset has no weights)."""
    paths = {}
    for role, ref in cfg.models.roles().items():
        p = Path(ref)
        if not (p / "config.json").is_file():
            raise UserError(f"{ref!r} is not a Hugging Face checkpoint folder (no config.json "
                            "there); realign run needs weights, a preset name has none",
                            field=f"models.{role}")
        paths[role] = p.resolve()
    return paths


def _check_weights(paths: dict[str, Path]) -> None:
    """Every model folder holds a supported architecture and weights whose headers
    match its config.json (every tensor there, of the right shape): read from the
    safetensors headers, before any worker starts."""
    from planner.search.problem import head_of
    from realign.runtime.hf_checkpoint import HFReader, check_checkpoint, spec_from_hf

    for role, path in paths.items():
        try:
            check_checkpoint(HFReader(path), spec_from_hf(path), head_of(role))
        except UserError as e:
            raise UserError(f"{path}: {e.message}", field=f"models.{role}") from None


def _check_eval(cfg: ExperimentConfig, tok: Any, train: Dataset) -> int:
    """The held-out prompts: a prompts file with answers, within the prompt length, none
    of them a training prompt; the verifier loads. How many each evaluation answers
    (:func:`~realign.run.planning.eval_prompts`, what the plan prices)."""
    from realign.data.datasets import load_dataset
    from realign.rewards.registry import load_reward_fn
    from realign.run.planning import eval_prompts

    ev = cfg.eval
    assert ev is not None             # called for an experiment with an eval section
    if ev.data.kind != "prompts" or ev.data.answer_key is None:
        raise UserError("the held-out set is prompts with reference answers (kind: prompts, "
                        "an answer_key)", field="eval.data.kind")
    held = load_dataset(ev.data, tok, field="eval.data")
    seen = {tuple(e.prompt_ids): e.line for e in train.examples}
    n = eval_prompts(cfg)
    assert n is not None              # an experiment with an eval section
    used = held.examples[:n]
    for e in used:
        if len(e.prompt_ids) > cfg.algorithm.prompt_len:
            raise UserError(f"{held.path} line {e.line}: the prompt has {len(e.prompt_ids)} "
                            f"tokens, more than algorithm.prompt_len = "
                            f"{cfg.algorithm.prompt_len}", field="eval.data")
        if tuple(e.prompt_ids) in seen:
            raise UserError(f"{held.path} line {e.line} is the training prompt of "
                            f"{train.path} line {seen[tuple(e.prompt_ids)]}: a held-out set "
                            "never overlaps the training prompts", field="eval.data")
    load_reward_fn(ev.verifier, field="eval.verifier")
    return len(used)


def _check_multi_turn(cfg: ExperimentConfig, generates: bool) -> None:
    """``rollout.env`` / ``rollout.tools``: an algorithm that generates, a turn that fits
    the response budget, and an environment class or tools that load and have the right
    shape (:mod:`realign.agents.loading`)."""
    from realign.agents.loading import env_factory

    r = cfg.rollout
    field = "rollout.env" if r.env is not None else "rollout.tools"
    if not generates and cfg.eval is None:
        raise UserError(f"{cfg.algorithm.name} generates nothing and there is no eval "
                        "section: environments and tools would never run", field=field)
    if r.turn_tokens is not None and r.turn_tokens > cfg.algorithm.gen_len:
        raise UserError(f"{r.turn_tokens} tokens per turn, more than the episode's whole "
                        f"budget algorithm.gen_len = {cfg.algorithm.gen_len}",
                        field="rollout.turn_tokens")
    env_factory(r)


def _run_folder(cfg: ExperimentConfig, run_dir: str | None) -> Path:
    folder = Path(run_dir or cfg.run.dir.format(name=cfg.name)).resolve()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file, not a folder", field="--run-dir" if run_dir
                        else "run.dir")
    return folder


def _vllm_engine(cfg: ExperimentConfig, models: dict[str, Any]) -> ExperimentConfig:
    """``rollout.engine`` checked against what can run here (:mod:`realign.run.vllm_check`):
    ``vllm`` that cannot is a :class:`UserError`; ``auto`` where vLLM cannot run prices
    realign's own engine only (and says why on stderr)."""
    import sys

    from planner.graph.dataflow import MFC
    from realign.run.planning import DTYPE_BYTES
    from realign.run.vllm_check import vllm_problem

    engine = cfg.rollout.engine
    if engine == "own" or "actor" not in models:
        return cfg
    a = cfg.algorithm
    gen = MFC(name="actor.generate", role="actor", kind="generate", n_seqs=1,
              prompt_len=a.prompt_len, gen_len=a.gen_len, input_keys=("prompts",),
              output_keys=("seqs",))
    problem = vllm_problem(cfg, models["actor"].spec, gen, DTYPE_BYTES[cfg.run_dtype()],
                           cfg.plan.cost.kv_cache_block_tokens)
    if problem is None:
        return cfg
    if engine == "vllm":
        raise problem
    print(f"rollout.engine auto: vLLM cannot run here ({problem.field}: {problem.message}); "
          "planning realign's own engine only", file=sys.stderr)
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": "own"})})


def prepare(experiment: str | Path, *, run_dir: str | None = None, steps: int | None = None,
            launcher: str | None = None, plan_file: Path | None = None,
            transform: Callable[[ExperimentConfig], ExperimentConfig] | None = None
            ) -> RunSpec:
    """Check the experiment, plan it and write the run folder; the prepared run.

    ``run_dir``, ``steps``, ``launcher``: the command line's overrides of ``run.dir``,
    ``run.steps`` and ``launcher.type``; ``plan_file``: run this saved plan (``plan.file``);
    ``transform``: a benchmark's change to the config (``cfg -> cfg``: a seed, a cluster)."""
    from planner.timeline_svg import render
    from realign.algorithms import registry
    from realign.data.datasets import load_dataset
    from realign.data.tokenizer import load_tokenizer, tokenizer_class
    from realign.run.loading import load_experiment
    from realign.run.plan_source import resolve_plan
    from realign.run.planning import resolve_models
    from realign.run.streaming_check import check_streaming_plan, check_streaming_runs

    cfg = load_experiment(experiment)
    cfg = _with_overrides(cfg, steps, launcher, plan_file)
    if transform is not None:
        cfg = transform(cfg)
    check_streaming_runs(cfg)
    cfg.cluster.spec()                           # a known device (cluster.device)
    if cfg.data is None:
        raise UserError("realign run needs a data section with a train dataset", field="data")
    algo = registry.get(cfg.algorithm.name)
    kind = algo.spec.data_kind
    if cfg.data.train.kind != kind:
        raise UserError(f"{algo.name} trains on {kind} data, the dataset is "
                        f"{cfg.data.train.kind!r}", field="data.train.kind")
    paths = _checkpoint_folders(cfg)
    models = resolve_models(cfg)
    _check_weights(paths)
    longest = cfg.algorithm.prompt_len + cfg.algorithm.gen_len
    for role, m in models.items():
        if longest > m.spec.max_seq_len:
            raise UserError(f"prompt_len + gen_len = {longest} tokens, more than the "
                            f"{m.spec.max_seq_len} that models.{role} takes "
                            "(max_position_embeddings)", field="algorithm.gen_len")
    for role, lc in cfg.lora.items():      # an adapter to start from fits its base
        if lc.init_from:
            from realign.runtime.lora_peft import check_peft_adapter
            check_peft_adapter(Path(lc.init_from), models[role].spec,
                               models[role].head, lc.spec(), f"lora.{role}.init_from")
    algo.check_roles(cfg.algorithm.params, set(paths))
    reward_fn = cfg.rule_reward_fn()
    if reward_fn is not None:
        from realign.rewards.registry import load_reward_fn
        load_reward_fn(reward_fn)
    if cfg.rollout.multi_turn:
        _check_multi_turn(cfg, algo.spec.generates)
    tok = load_tokenizer(paths[cfg.tokenizer_role()])
    data = load_dataset(cfg.data.train, tok, field="data.train")
    too_long = [e for e in data.examples if len(e.prompt_ids) > cfg.algorithm.prompt_len]
    if too_long:
        e = too_long[0]
        raise UserError(f"{data.path} line {e.line}: the prompt has {len(e.prompt_ids)} tokens, "
                        f"more than algorithm.prompt_len = {cfg.algorithm.prompt_len}",
                        field="data.train")
    if cfg.train.transformer_engine and cfg.device != "cuda":
        raise UserError("Transformer-Engine runs on CUDA only; leave it off on cpu",
                        field="train.transformer_engine")
    eval_prompts = _check_eval(cfg, tok, data) if cfg.eval is not None else None
    if cfg.device == "cpu" and cfg.cluster.device != "cpu":
        raise UserError("device 'cpu' needs cluster.device 'cpu' (the plan must be for the "
                        "machine that runs it)", field="cluster.device")
    cfg = _vllm_engine(cfg, models)
    plan = resolve_plan(cfg, models)
    check_streaming_plan(cfg, plan)
    on_vllm = [plan.graph.mfc(a.mfc) for a in plan.allocations if a.engine == "vllm"]
    if on_vllm:                                  # a saved plan may name vLLM too
        from realign.run.planning import DTYPE_BYTES
        from realign.run.vllm_check import check_vllm
        check_vllm(cfg, models["actor"].spec, on_vllm, DTYPE_BYTES[cfg.run_dtype()],
                   plan.cost_config.kv_cache_block_tokens,
                   {a.mfc: a.layout.tp for a in plan.allocations if a.engine == "vllm"})
    from realign.run.vllm_check import replay_with_recompute, routing_replay_problem
    sampled = any(m.role == "actor" and not m.greedy and not m.is_eval for m in on_vllm)
    problem = routing_replay_problem(cfg, models["actor"].spec, sampled
                                     ) if "actor" in models else None
    if problem is not None:
        raise problem
    if "actor" in models:
        cfg = replay_with_recompute(cfg, models["actor"].spec, sampled, any(
            a.role == "actor" and a.kind == "train" and a.activation_recompute
            for a in plan.allocations))
    spec = RunSpec(config=cfg, plan=plan, paths=paths,
                   run_dir=_run_folder(cfg, run_dir),
                   tokenizer_role=cfg.tokenizer_role(), tokenizer_class=tokenizer_class(tok),
                   reward_fn=reward_fn,
                   verifier=cfg.eval.verifier if cfg.eval is not None else None,
                   eval_prompts=eval_prompts)
    spec.program()                               # the plan compiles (before any write)
    timeline = render(plan)
    try:
        spec.run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make the run folder {spec.run_dir}: {e.strerror}",
                        field="--run-dir" if run_dir else "run.dir") from None
    for name, text in (("plan.json", plan.to_json()),
                       ("plan.svg", timeline),                   # reallocations show as bars
                       ("experiment.json", json.dumps(cfg.model_dump(mode="json"), indent=1))):
        save_file(text.encode(), spec.run_dir / name)
    spec.save()
    return spec
