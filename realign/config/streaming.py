"""Checks of ``rollout.mode: streaming`` (a generator that streams into a rollout
buffer, :mod:`planner.graph.streaming`): a validator of the experiment schema
(:class:`~realign.config.experiment.ExperimentConfig` runs it on every config it
builds), so before anything is planned or started.

Every combination the streaming schedule does not cover is named with its field; the
others are planned (``realign plan``: ``plan.streaming``) and run
(:mod:`realign.worker.stream_worker`; what the runtime refuses beyond these, once the
plan is made: :mod:`realign.run.streaming_check`). A refused combination exits 2 before
any worker starts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from planner.graph.algorithms import algorithm_spec
from realign.algorithms.params import DAPOConfig
from realign.errors import UserError

if TYPE_CHECKING:
    from realign.config.experiment import ExperimentConfig

#: the calls whose GPUs a streaming plan keeps apart
GENERATE_MFC, TRAIN_MFC = "actor.generate", "actor.train"


def check_streaming(cfg: ExperimentConfig) -> None:
    """Refuse the combinations ``rollout.mode: streaming`` does not cover (and
    ``rollout.on_update`` without it), naming the field at fault: the first one found."""
    r, a = cfg.rollout, cfg.algorithm
    if r.mode != "streaming":
        if r.on_update != "continue":
            raise UserError(f"rollout.on_update is {r.on_update!r}, but it is read only "
                            "with rollout.mode: streaming (rollout.mode is "
                            f"{r.mode!r}); remove it", field="rollout.on_update")
        return
    if not algorithm_spec(a.name).generates:
        raise UserError(f"rollout.mode: streaming streams generated samples, and {a.name} "
                        "generates none; use rollout.mode: step", field="rollout.mode")
    if a.max_staleness < 1:
        raise UserError(f"rollout.mode: streaming trains on samples made by older weights; "
                        f"algorithm.max_staleness is {a.max_staleness}, allowed: 1 or more",
                        field="algorithm.max_staleness")
    if a.name == "dapo":
        # DAPO streams with its dynamic sampling at the buffer (a finished group whose rule
        # rewards are all equal is dropped there, and the generator keeps generating until
        # a batch is full): so no sampling rounds, and rewards the generator scores
        p = cfg.algorithm.params
        assert isinstance(p, DAPOConfig), type(p)
        if p.max_sampling_rounds > 1:
            raise UserError(f"algorithm.params.max_sampling_rounds is {p.max_sampling_rounds}, "
                            "but rollout.mode: streaming fills DAPO's batch itself (the buffer "
                            "drops the constant groups and the generator keeps generating "
                            "until a batch of the others is there); allowed: 1",
                            field="algorithm.params.max_sampling_rounds")
        if p.dynamic_sampling and cfg.models.reward is not None:
            raise UserError("models.reward is set, but rollout.mode: streaming drops DAPO's "
                            "constant groups at the buffer, on the generator, which scores "
                            "rule rewards only (a reward model scores a batch on the training "
                            "side, after the buffer); use reward.fn, dynamic_sampling: false, "
                            "or rollout.mode: step", field="models.reward")
    if r.multi_turn:
        raise UserError("rollout.mode: streaming with multi-turn episodes (rollout.env / "
                        "rollout.tools) is not supported; use rollout.mode: step",
                        field="rollout.mode")
    if r.engine != "own":
        raise UserError(f"rollout.engine is {r.engine!r}; rollout.mode: streaming pauses "
                        "realign's own engine between decode iterations for the weights, "
                        "allowed: own", field="rollout.engine")
    manual = cfg.plan.manual or {}
    if GENERATE_MFC in manual and TRAIN_MFC in manual:
        g, t = manual[GENERATE_MFC].mesh, manual[TRAIN_MFC].mesh
        if set(g.gpus) & set(t.gpus):
            raise UserError(
                f"plan.manual places {GENERATE_MFC} on GPUs {g.first_gpu}..{g.first_gpu + g.n_gpus - 1} "
                f"and {TRAIN_MFC} on {t.first_gpu}..{t.first_gpu + t.n_gpus - 1}: a generator that "
                "streams needs GPUs of its own, disjoint from training's",
                field=f"plan.manual.{GENERATE_MFC}.mesh")

