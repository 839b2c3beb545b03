"""What a run on vLLM (``rollout.engine``) needs, checked before any worker starts.

Torch-free and vLLM-free: nothing here imports vLLM, it only looks for it. A generate
call runs on vLLM when the plan says so (``engine: vllm`` in its allocation: always
with ``rollout.engine: vllm``, where the search chose it under ``auto``). Then:

* vLLM is installed in the environment that runs the workers (``make vllm-env``
  builds ``.venv-vllm``; docs/vllm.md);
* on the cpu device the model's head dimension is at least :data:`CPU_MIN_HEAD_DIM`
  (vLLM's CPU attention kernels refuse smaller heads);
* ``rollout.vllm.kv_cache_gib`` holds at least one sequence of ``prompt_len +
  gen_len`` tokens (:func:`planner.cost.vllm_cost.kv_bytes_per_seq`, what the plan
  prices);
* on the cpu device, a call at TP ``t`` has ``t`` cores (one per vLLM worker). vLLM's
  TP is the plan's (any TP, PP 1: :mod:`planner.plan` refuses the rest);
* on the cpu device, a mixture of experts' per-TP-rank expert width
  (``moe_intermediate_size / t``) is a multiple of :data:`CPU_EXPERT_ALIGN`: vLLM's CPU
  experts pad it to one, and an in-memory weight update of padded experts stops inside
  vLLM's worker (docs/vllm.md, "A mixture of experts on vLLM");
* ``rollout.routing_replay: on`` can replay (:func:`routing_replay_problem`), and the
  actor's train calls can force the experts (:func:`replay_with_recompute`).

Each failure is a :class:`~realign.errors.UserError` naming the setting to change.
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from planner.cost.vllm_cost import kv_bytes_per_seq
from planner.graph.dataflow import MFC
from planner.specs.model_spec import ModelSpec
from realign.errors import UserError

if TYPE_CHECKING:
    from realign.config.experiment import ExperimentConfig

#: vLLM's CPU attention needs heads of at least this many channels
CPU_MIN_HEAD_DIM = 32

#: vLLM's CPU experts pad their per-TP-rank intermediate size to a multiple of this
#: (``CPUUnquantizedExperts.output_alignment``), which an in-memory update cannot fill
CPU_EXPERT_ALIGN = 32

GIB = 2 ** 30


def vllm_installed() -> bool:
    """vLLM can be imported by this interpreter (looked up, not imported). A folder
    named ``vllm`` on the path without an ``__init__`` (a namespace package, such as a
    test folder on pytest's path) is not vLLM."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def vllm_problem(cfg: "ExperimentConfig", spec: ModelSpec, mfc: MFC,
                 dtype_bytes: int, block_tokens: int) -> UserError | None:
    """Why the actor's generate call ``mfc`` cannot run on vLLM here (None: it can)."""
    if not vllm_installed():
        return UserError("vLLM is not installed in this environment: build it with `make "
                         "vllm-env` and run from .venv-vllm (docs/vllm.md), or set "
                         "rollout.engine to own", field="rollout.engine")
    if cfg.device == "cpu" and spec.kv_channels < CPU_MIN_HEAD_DIM:
        return UserError(f"{spec.name} has heads of {spec.kv_channels} channels; vLLM on "
                         f"cpu needs at least {CPU_MIN_HEAD_DIM}: use a model with wider "
                         "heads, or set rollout.engine to own", field="models.actor")
    per = kv_bytes_per_seq(spec, mfc, dtype_bytes, block_tokens)
    have = cfg.rollout.vllm.kv_cache_gib * GIB
    if have < per:
        return UserError(f"{have / GIB:.4g} GiB of KV cache cannot hold one sequence of "
                         f"{mfc.seq_len} tokens of {spec.name} ({per / GIB:.4g} GiB); raise "
                         "it", field="rollout.vllm.kv_cache_gib")
    return None


def cpu_tp_problem(cfg: "ExperimentConfig", mfc: str, tp: int,
                   cores: int) -> UserError | None:
    """Why vLLM at TP ``tp`` cannot run the call ``mfc`` on this machine's ``cores``
    usable cores (None: it can): on the cpu device each of its TP workers is bound to
    cores of its own, so it needs at least ``tp``."""
    if cfg.device != "cpu" or tp <= cores:
        return None
    return UserError(f"{mfc} runs on vLLM at tp {tp}, whose CPU workers need a core each; "
                     f"this machine lets realign use {cores}: give it tp {cores} or less in "
                     "plan.manual, or set rollout.engine to own",
                     field=f"plan.manual.{mfc}")


def cpu_moe_problem(cfg: "ExperimentConfig", spec: ModelSpec, mfc: str,
                    tp: int) -> UserError | None:
    """Why vLLM on the cpu device cannot take in-memory updates of the mixture of
    experts ``spec`` at TP ``tp`` for the call ``mfc`` (None: it can): each TP rank's
    share of an expert's intermediate size must be a multiple of
    :data:`CPU_EXPERT_ALIGN`.

    Example: experts of 64 -> TP 1 and 2 pass; TP 4 (16 per rank) is refused, naming
    ``plan.manual.<mfc>`` and TP 1 and 2; experts of 48 are refused at every TP."""
    if cfg.device != "cpu" or spec.moe is None:
        return None
    width = spec.moe.expert_ffn_hidden
    if width % tp == 0 and (width // tp) % CPU_EXPERT_ALIGN == 0:
        return None
    allowed = [t for t in range(1, width // CPU_EXPERT_ALIGN + 1)
               if width % (t * CPU_EXPERT_ALIGN) == 0]
    why = (f"{spec.name}'s experts of {width} (moe_intermediate_size) at tp {tp} give "
           f"{width / tp:g} per TP rank; vLLM's cpu experts need a multiple of "
           f"{CPU_EXPERT_ALIGN} per rank (it pads the rest, and a padded expert cannot "
           "take realign's in-memory weight update)")
    if not allowed:
        return UserError(f"{why}: use a model whose moe_intermediate_size is a multiple of "
                         f"{CPU_EXPERT_ALIGN}, or set rollout.engine to own",
                         field="models.actor")
    return UserError(f"{why}: give {mfc} tp {' or '.join(map(str, allowed))} in "
                     "plan.manual, or set rollout.engine to own", field=f"plan.manual.{mfc}")


def check_vllm(cfg: "ExperimentConfig", spec: ModelSpec, calls: list[MFC],
               dtype_bytes: int, block_tokens: int,
               tps: dict[str, int] | None = None) -> None:
    """Raise the first :func:`vllm_problem` of ``calls`` (the generate calls that run on
    vLLM), then the first :func:`cpu_tp_problem` and :func:`cpu_moe_problem` of their TP
    (``tps``, by call)."""
    import os

    for m in calls:
        problem = vllm_problem(cfg, spec, m, dtype_bytes, block_tokens)
        if problem is not None:
            raise problem
    cores = len(os.sched_getaffinity(0))
    for name, tp in (tps or {}).items():
        problem = cpu_tp_problem(cfg, name, tp, cores) or cpu_moe_problem(cfg, spec, name, tp)
        if problem is not None:
            raise problem


def routing_replay_problem(cfg: "ExperimentConfig", spec: ModelSpec,
                           rollout_on_vllm: bool) -> UserError | None:
    """Why ``rollout.routing_replay: on`` cannot replay in this run (None: it can, or
    the setting is not on): the actor (``spec``) has no experts; its rollout
    (``rollout_on_vllm``: the plan's sampled generate call runs on vLLM) runs on
    realign's own engine, whose generation is the training forward (same router, same
    experts: nothing to replay); vLLM runs on CUDA (CUDA graphs: no routing recorded,
    :func:`realign.runtime.engines.vllm_routing.records_routing`); or the rollout is
    multi-turn (an episode's turns are not recorded as one sequence)."""
    if cfg.rollout.routing_replay != "on":
        return None
    why = None
    if spec.moe is None:
        why = f"the actor {spec.name} is dense: it has no experts to replay"
    elif not rollout_on_vllm:
        why = ("the actor's rollout runs on realign's own engine, whose routing is the "
               "training forward's (same router, same experts): there is nothing to replay; "
               "set rollout.engine vllm")
    elif cfg.device != "cpu":
        why = ("vLLM on CUDA runs its decode steps as CUDA graphs, where realign cannot "
               "record the experts it routes to (docs/vllm.md)")
    elif cfg.rollout.multi_turn:
        why = "a multi-turn rollout's routing is not recorded"
    if why is None:
        return None
    return UserError(f"rollout.routing_replay is 'on' but {why}; use 'auto' (replay where "
                     "the rollout's routing is recorded) or 'off'",
                     field="rollout.routing_replay")


def replay_with_recompute(cfg: "ExperimentConfig", spec: ModelSpec, rollout_on_vllm: bool,
                          recomputed_actor_train: bool) -> "ExperimentConfig":
    """``rollout.routing_replay`` against the plan's activation recompute: megatron's
    recomputed layers (``train.forward: megatron``) rerun their forward in the backward,
    after the rollout's experts are no longer set, so a replayed train call planned with
    recompute (``recomputed_actor_train``) cannot hold the routing. Then ``on`` is a
    :class:`UserError` naming the field; ``auto`` replays nothing (the config returned
    with ``off``, said on stderr). Otherwise ``cfg`` unchanged."""
    import sys

    replays = (spec.moe is not None and rollout_on_vllm and cfg.device == "cpu"
               and not cfg.rollout.multi_turn)
    mode = cfg.rollout.routing_replay
    if (mode == "off" or not replays or not recomputed_actor_train
            or cfg.train.forward != "megatron"):
        return cfg
    why = ("the plan recomputes the actor's train activations and megatron's recomputed "
           "layers rerun their forward after the rollout's experts are no longer set")
    if mode == "on":
        raise UserError(f"rollout.routing_replay is 'on' but {why}; use train.forward plain "
                        "(its recomputation replays), plan.cost.recompute never, or "
                        "rollout.routing_replay auto or off", field="rollout.routing_replay")
    print(f"rollout.routing_replay auto: {why}; the rollout's routing is not replayed",
          file=sys.stderr)
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
        update={"routing_replay": "off"})})
