"""From an experiment config to the planner's inputs, and to a searched plan."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.cost.cost_config import CostModelConfig
from planner.cost.profile import ProfileTable
from planner.cost.vllm_cost import VLLM_MAX_LORA_RANK
from planner.errors import InfeasibleError, PlanError
from planner.graph.algorithms import MAX_DROPPED_GROUP_FRAC, EvalShape, algorithm_spec, build_graph
from planner.graph.dataflow import DataflowGraph
from planner.graph.lengths import GenLengths
from planner.graph.packing import packed_graph
from planner.graph.refill import refill_graph
from planner.graph.turns import Turns
from planner.plan import ExecutionPlan
from planner.search.modes import MODES, choose_mode
from planner.search.problem import RoleModel, head_of
from planner.search.search import SearchSettings, search
from planner.search.stream_search import search_ahead
from planner.specs.model_spec import model_presets, model_spec_from_hf_config
from realign.algorithms.params import ClippedPGParams, max_round_prompts, max_sampling_rounds
from realign.config.experiment import ExperimentConfig, LoraConfig
from realign.errors import UserError
from realign.run.host_work import resolve_host_work
from realign.run.lengths import (
    data_prompt_lengths,
    recorded_drop_frac,
    recorded_lengths,
    recorded_turns,
)
from realign.run.shared_base import with_shared_bases
from realign.run.spec import final_role


def resolve_models(cfg: ExperimentConfig) -> dict[str, RoleModel]:
    presets = model_presets()
    out = {}
    loras: dict[str, LoraConfig] = {role: lc for role, lc in cfg.lora.items()}
    for role, ref in cfg.models.roles().items():
        if ref in presets:
            spec = presets[ref]
        else:
            p = Path(ref)
            if not p.exists():
                raise UserError(f"{ref!r} is neither a preset ({', '.join(sorted(presets))}) "
                                "nor an existing path to a Hugging Face config.json",
                                field=f"models.{role}")
            try:
                spec = model_spec_from_hf_config(p, name=p.name if p.is_dir() else p.parent.name)
            except PlanError as e:
                raise UserError(str(e).removeprefix("model: "), field=f"models.{role}") from None
        lora = loras.get(role)
        if lora is not None and spec.moe is not None:
            raise UserError(f"LoRA on a mixture of experts ({spec.family}) is not supported: "
                            f"train the full model, or remove lora.{role}", field=f"lora.{role}")
        out[role] = RoleModel(role, spec, head_of(role), lora.spec() if lora else None)
    check_lora(cfg)
    return out


def check_lora(cfg: ExperimentConfig) -> None:
    """:class:`UserError` for a ``lora.<role>`` the experiment cannot train: a role with
    no model, or one the algorithm does not train; or a setting LoRA cannot run with
    (vLLM generation, Transformer-Engine layers)."""
    if not cfg.lora:
        return
    models = cfg.models.roles()
    graph = build_graph(cfg.algorithm.name, cfg.algorithm.shape(), set(models))
    trained = graph.trainable_roles()
    for role in cfg.lora:
        if role not in models:
            raise UserError(f"there is no models.{role} to put adapters on (models: "
                            f"{', '.join(sorted(models)) or 'none'})", field=f"lora.{role}")
        if role not in trained:
            raise UserError(f"{cfg.algorithm.name} does not train the {role} (it trains: "
                            f"{', '.join(sorted(trained)) or 'nothing'}); LoRA applies to "
                            "trained roles only", field=f"lora.{role}")
    final = final_role(graph)
    for role, lc in cfg.lora.items():
        if lc.merged and role != final:
            raise UserError(f"the run writes only the {final} at the end (final/{final}); "
                            f"the {role}'s adapters stay in its checkpoints: leave merged "
                            "off", field=f"lora.{role}.merged")
    actor = cfg.lora.get("actor")
    if actor is not None and cfg.rollout.engine == "vllm" and actor.rank > VLLM_MAX_LORA_RANK:
        raise UserError(f"vLLM's LoRA takes ranks up to {VLLM_MAX_LORA_RANK}, not "
                        f"{actor.rank}: lower it, or set rollout.engine to own or auto",
                        field="lora.actor.rank")
    if cfg.train.transformer_engine:
        raise UserError("LoRA runs on megatron's local layers (Transformer-Engine fuses the "
                        "norm into the adapted linear layers); leave train.transformer_engine "
                        "off", field="train.transformer_engine")


#: bytes per parameter of each run dtype
DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def cost_config(cfg: ExperimentConfig, host_work: bool = False) -> CostModelConfig:
    """``plan.cost`` pricing what the run executes: its optimizer
    (``train.distributed_optimizer``) and its parameter dtype (``dtype``), both resolved
    for ``device``, unless ``plan.cost`` says otherwise, which must then agree; with
    ``host_work`` also the host work of its steps
    (:func:`realign.run.host_work.resolve_host_work`)."""
    cost = cfg.plan.cost
    runs = cfg.train.uses_distributed_optimizer(cfg.device)
    if "distributed_optimizer" in cost.model_fields_set and cost.distributed_optimizer != runs:
        raise UserError(f"plan.cost.distributed_optimizer is {cost.distributed_optimizer} but "
                        f"the run's optimizer is {'' if runs else 'not '}distributed "
                        f"(train.distributed_optimizer, device {cfg.device}); set them alike "
                        "or leave plan.cost.distributed_optimizer out",
                        field="plan.cost.distributed_optimizer")
    dtype_bytes = DTYPE_BYTES[cfg.run_dtype()]
    if "param_dtype_bytes" in cost.model_fields_set and cost.param_dtype_bytes != dtype_bytes:
        raise UserError(f"plan.cost.param_dtype_bytes is {cost.param_dtype_bytes} but the run "
                        f"trains in {cfg.run_dtype()} ({dtype_bytes} bytes; dtype, device "
                        f"{cfg.device}); set them alike or leave plan.cost.param_dtype_bytes "
                        "out", field="plan.cost.param_dtype_bytes")
    engine = cfg.rollout.engine
    if "generate_engine" in cost.model_fields_set and cost.generate_engine != engine:
        raise UserError(f"plan.cost.generate_engine is {cost.generate_engine} but "
                        f"rollout.engine is {engine}; set rollout.engine alone",
                        field="plan.cost.generate_engine")
    vllm = cfg.rollout.vllm
    cost = cost.model_copy(update={"distributed_optimizer": runs,
                                   "param_dtype_bytes": dtype_bytes,
                                   "generate_engine": engine,
                                   "decode_capture": cfg.rollout.capture,
                                   "vllm_max_num_seqs": vllm.max_num_seqs,
                                   "vllm_kv_cache_bytes": vllm.kv_cache_gib * 2 ** 30})
    return resolve_host_work(cfg, cost) if host_work else cost


def eval_shape(cfg: ExperimentConfig) -> EvalShape | None:
    """The evaluation's shape (None: no ``eval`` section): :func:`eval_prompts` prompts,
    so that a plan prices the evaluation that runs."""
    n = eval_prompts(cfg)
    if cfg.eval is None or n is None:
        return None
    return EvalShape(n_prompts=n, samples=cfg.eval.samples, every=cfg.eval.interval)


def eval_prompts(cfg: ExperimentConfig) -> int | None:
    """How many held-out prompts each evaluation answers: the first ``eval.max_prompts``
    rows of the held-out file, or all of them (its non-blank lines, one prompt each, as
    :func:`realign.data.jsonl.read_jsonl` reads them); None without an eval section."""
    if cfg.eval is None:
        return None
    p = Path(cfg.eval.data.path)
    try:
        rows = sum(1 for line in p.read_text(encoding="utf-8").splitlines() if line.strip())
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the held-out prompts {p} ({e})", field="eval.data.path") \
            from None
    if rows == 0:
        raise UserError(f"{p} holds no prompts", field="eval.data.path")
    return min(rows, cfg.eval.max_prompts or rows)


#: plan section fields that are not search settings
_NOT_SEARCH_SETTINGS = {"cost", "profile", "lengths_from", "file", "manual"}


def graph_lengths(cfg: ExperimentConfig) -> tuple[GenLengths | None, GenLengths | None]:
    """(response lengths, prompt lengths) the experiment's graph carries: a recorded
    run's (``plan.lengths_from``) and the training data's (tokenized here, so a caller
    that builds several graphs reads them once)."""
    return recorded_lengths(cfg), data_prompt_lengths(cfg)


def experiment_graph(cfg: ExperimentConfig, models: dict[str, RoleModel],
                     asynchronous: bool = False,
                     lengths: tuple[GenLengths | None, GenLengths | None] | None = None
                     ) -> DataflowGraph:
    """The dataflow graph of the experiment: its algorithm, batch shape, model roles,
    fixed train micro-batch count (``train.micro_batches``), evaluation, the
    generation lengths (``plan.lengths_from``, else ``algorithm.gen_len_mean``), the
    training prompts' lengths (``data.train``) and its staleness bound;
    ``asynchronous``: generation one step ahead of training; scoring and training
    packed with ``train.packing``; generation refilling its slots with
    ``rollout.refill``; DAPO's sampling rounds priced (``max_sampling_rounds``,
    ``max_round_prompts``, at the drop rate ``plan.lengths_from`` recorded, else
    ``algorithm.dropped_group_frac``); a frozen
    role that is a LoRA model's base scored by that model, adapters off
    (:mod:`realign.run.shared_base`); ``lengths``:
    :func:`graph_lengths`, read already (None: read here)."""
    responses, prompts = lengths if lengths is not None else graph_lengths(cfg)
    graph = build_graph(cfg.algorithm.name, cfg.algorithm.shape(), set(models),
                       train_micro_batches=cfg.train.micro_batches,
                       evaluation=eval_shape(cfg), lengths=responses,
                       max_staleness=cfg.algorithm.max_staleness, asynchronous=asynchronous,
                       prompt_lengths=prompts, score_rollout=scores_rollout(cfg),
                       turns=turns_shape(cfg),
                       max_sampling_rounds=max_sampling_rounds(cfg.algorithm.params),
                       max_round_prompts=max_round_prompts(cfg.algorithm.params),
                       sampling_drop_frac=recorded_drop_frac(cfg))
    graph = refill_graph(graph) if cfg.rollout.refill else graph
    graph = with_shared_bases(graph, cfg)     # a reference that is the actor's base
    return packed_graph(graph) if cfg.train.packing else graph


def turns_shape(cfg: ExperimentConfig) -> Turns | None:
    """The multi-turn shape of every generate call (``rollout.env`` / ``rollout.tools``):
    turns of at most ``turn_tokens`` (else ``algorithm.gen_len``) in ``env_groups``
    groups; the turns per episode, tokens per observation and environment seconds per
    turn are ``rollout.plan_turns``, ``plan_observation_tokens`` and ``plan_env_s`` where
    given, else what the run of ``plan.lengths_from`` measured
    (:func:`~realign.run.lengths.recorded_turns`), else ``max_turns``,
    ``max_observation_tokens`` and 0."""
    r = cfg.rollout
    if not r.multi_turn:
        return None
    seen = recorded_turns(cfg)
    obs = r.plan_observation_tokens
    return Turns(turns=min(float(r.max_turns), r.plan_turns or seen.get("turns", r.max_turns)),
                 turn_tokens=r.turn_tokens or cfg.algorithm.gen_len,
                 obs_tokens=obs if obs is not None else round(
                     seen.get("obs_tokens", r.max_observation_tokens)),
                 env_s=r.plan_env_s if "plan_env_s" in r.model_fields_set
                 else seen.get("env_s", 0.0), groups=r.env_groups)


def scores_rollout(cfg: ExperimentConfig) -> bool:
    """Whether the actor's training forward scores the rollout before its update
    (``actor.prox_inference`` in a synchronous graph too): where vLLM may generate
    (``rollout.engine`` vllm or auto), to measure the log-prob mismatch every step, and
    with ``algorithm.params.tis_cap`` set, to correct for it. Only the algorithms that
    take a behaviour correction (the clipped policy-gradient family) do."""
    spec = algorithm_spec(cfg.algorithm.name)
    params = cfg.algorithm.params
    tis = isinstance(params, ClippedPGParams) and params.tis_cap is not None
    if not (spec.generates and spec.runs_ahead):
        return False
    return cfg.rollout.scores_rollout() or tis


def allows_async(cfg: ExperimentConfig) -> bool:
    """The experiment lets generation run ahead (a staleness bound); a bound on an
    algorithm that generates nothing is a :class:`UserError`."""
    if cfg.algorithm.max_staleness >= 1 and not algorithm_spec(cfg.algorithm.name).generates:
        raise UserError(f"{cfg.algorithm.name} generates nothing, so nothing can run ahead "
                        "of training; leave max_staleness at 0", field="algorithm.max_staleness")
    return cfg.algorithm.max_staleness >= 1


def load_profile(cfg: ExperimentConfig) -> ProfileTable | None:
    """The profile table ``plan.profile`` names, or None.
    It must have been measured in the run's dtype on the cluster's device: its rates
    are only true for those."""
    if not cfg.plan.profile:
        return None
    table = ProfileTable.load(Path(cfg.plan.profile))
    if table.measured.dtype != cfg.run_dtype():
        raise PlanError(f"{table.source} was measured in {table.measured.dtype}; this run "
                        f"computes in {cfg.run_dtype()} (measure with realign profile "
                        f"--dtype {cfg.run_dtype()})", field="plan.profile")
    dev = cfg.cluster.device if isinstance(cfg.cluster.device, str) else cfg.cluster.device.name
    if table.device != dev:
        raise PlanError(f"{table.source} was measured on device {table.device!r}; the "
                        f"cluster's is {dev!r}", field="plan.profile")
    return table


def plan_experiment(cfg: ExperimentConfig, overrides: dict[str, Any] | None = None) -> ExecutionPlan:
    """Search the execution plan of an experiment (``overrides``: search settings).
    With ``algorithm.max_staleness`` >= 1 both modes are searched (each with half of
    ``plan.time_limit_s``) and the faster estimate wins (the synchronous on a tie); with
    ``rollout.mode: streaming`` the streaming one too (from the asynchronous mode's
    split plans), and it is the one that runs; the plan lists them
    (:attr:`~planner.plan.ExecutionPlan.modes`)."""
    if not allows_async(cfg):
        return plan_mode(cfg, False, overrides)
    if cfg.rollout.mode == "streaming":         # the stream runs; the others compared
        plans, why = searched_modes(cfg, MODES, overrides)
        if plans["streaming"] is None:
            raise InfeasibleError(f"no streaming plan fits ({why}); rollout.mode: step "
                                  "runs the synchronous or one-step-ahead plan",
                                  field="rollout.mode")
        return choose_mode(plans, run="streaming")
    sync, asyn, _why = both_modes(cfg, overrides)
    return compare_modes(sync, asyn)


def plan_mode(cfg: ExperimentConfig, asynchronous: bool,
              overrides: dict[str, Any] | None = None,
              lengths: tuple[GenLengths | None, GenLengths | None] | None = None
              ) -> ExecutionPlan:
    """The searched plan of one execution mode (``lengths``: :func:`graph_lengths`,
    read already)."""
    models = resolve_models(cfg)
    graph = experiment_graph(cfg, models, asynchronous, lengths)
    return search(cfg.name, graph, models, cfg.cluster.spec(), cost_config(cfg, host_work=True),
                  load_profile(cfg), search_settings(cfg, overrides))


def plan_ahead(cfg: ExperimentConfig, overrides: dict[str, Any] | None = None,
               lengths: tuple[GenLengths | None, GenLengths | None] | None = None
               ) -> tuple[ExecutionPlan, ExecutionPlan]:
    """(the one-step-ahead plan, the streaming plan), from the same search of each split
    (:func:`planner.search.stream_search.search_ahead`): the split, each side's layouts
    and the staleness bound, by the stream's predicted steady state (DAPO's constant
    groups dropped at the buffer at the share the synchronous plan prices: the one
    ``plan.lengths_from`` recorded, else ``algorithm.dropped_group_frac``)."""
    models = resolve_models(cfg)
    graph = experiment_graph(cfg, models, True, lengths)
    shape = cfg.algorithm.shape()
    return search_ahead(cfg.name, graph, models, cfg.cluster.spec(),
                        shape.samples_per_prompt, cfg.rollout.on_update,
                        cost_config(cfg, host_work=True), load_profile(cfg),
                        search_settings(cfg, overrides),
                        constant_share=dapo_drop_frac(cfg, shape.dropped_group_frac))


def dapo_drop_frac(cfg: ExperimentConfig, configured: float | None) -> float:
    """DAPO's share of constant groups as the plans price it: the one
    ``plan.lengths_from`` recorded (:func:`recorded_drop_frac`), else ``configured``
    (``algorithm.dropped_group_frac``), else 0; at most the 0.95 a plan over-generates
    for."""
    recorded = recorded_drop_frac(cfg) if cfg.algorithm.name == "dapo" else None
    return min(MAX_DROPPED_GROUP_FRAC,
               recorded if recorded is not None else configured or 0.0)


def both_modes(cfg: ExperimentConfig, overrides: dict[str, Any] | None = None
               ) -> tuple[ExecutionPlan | None, ExecutionPlan | None, str]:
    """(best synchronous plan, best asynchronous plan, why one is missing): each is
    None when no plan of that mode fits."""
    plans, why = searched_modes(cfg, MODES[:2], overrides)
    return plans["synchronous"], plans["asynchronous"], why


def searched_modes(cfg: ExperimentConfig, modes: tuple[str, ...],
                   overrides: dict[str, Any] | None = None
                   ) -> tuple[dict[str, ExecutionPlan | None], str]:
    """(mode -> its best plan, why one is missing) for ``modes`` of
    :data:`~planner.search.modes.MODES`: the synchronous and the asynchronous search
    each with half of ``plan.time_limit_s`` (streaming read from the asynchronous
    one's); None where none of a mode fits (an :class:`InfeasibleError` where none of
    any does)."""
    settings = search_settings(cfg, overrides)
    cfg = with_host_work(cfg)          # timed once for every mode
    lengths = graph_lengths(cfg)       # and the data read once
    half = {**(overrides or {}), "time_limit_s": settings.time_limit_s / 2}
    plans: dict[str, ExecutionPlan | None] = {m: None for m in modes}
    why = ""
    try:
        plans["synchronous"] = plan_mode(cfg, False, half, lengths)
    except InfeasibleError as e:
        why = e.message
    try:
        if "streaming" in modes:
            plans["asynchronous"], plans["streaming"] = plan_ahead(cfg, half, lengths)
        else:
            plans["asynchronous"] = plan_mode(cfg, True, half, lengths)
    except InfeasibleError as e:
        why = e.message
    if all(p is None for p in plans.values()):
        raise InfeasibleError(why, field="cluster")
    return plans, why


def compare_modes(sync: ExecutionPlan | None, asyn: ExecutionPlan | None) -> ExecutionPlan:
    """The faster of the two (the synchronous on a tie), listing both; at least one is
    a plan (:func:`both_modes` raises where neither fits)."""
    return choose_mode({"synchronous": sync, "asynchronous": asyn})


def search_settings(cfg: ExperimentConfig, overrides: dict[str, Any] | None = None) -> SearchSettings:
    """The plan section's search settings, with ``overrides`` (None values ignored)."""
    fields = cfg.plan.model_dump(exclude=_NOT_SEARCH_SETTINGS)
    fields.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return SearchSettings(**fields)


def with_profile(cfg: ExperimentConfig, path: str | Path) -> ExperimentConfig:
    """``cfg`` priced with the profile table at ``path`` (a command line's
    ``--profile``, over ``plan.profile``); :func:`load_profile` checks it."""
    plan = cfg.plan.model_copy(update={"profile": str(Path(path).resolve())})
    return cfg.model_copy(update={"plan": plan})


def with_host_work(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with ``plan.cost``'s host work resolved once (timed here when it plans
    with a profile), so that every plan priced from it uses the same numbers."""
    cost = resolve_host_work(cfg, cfg.plan.cost)
    return cfg.model_copy(update={"plan": cfg.plan.model_copy(update={"cost": cost})})


def priced_with(cfg: ExperimentConfig, profile_src: str | Path | None) -> ExperimentConfig:
    """``cfg`` priced with the profile table at ``profile_src``, or analytically (no
    profile, whatever ``plan.profile`` says) when it is None."""
    if profile_src is not None:
        return with_profile(cfg, profile_src)
    return cfg.model_copy(update={"plan": cfg.plan.model_copy(update={"profile": None})})
