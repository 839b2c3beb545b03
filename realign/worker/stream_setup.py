"""A worker's side of a streaming run (``rollout.mode: streaming``): the generator on
the rollout call's GPU, the training side elsewhere (:mod:`realign.worker.stream_worker`),
built from the session's program, plan and config; and the prompts of the stream's
groups, in the order of the training data (group ``j`` is row ``j mod P`` of the
sampler's ``j div P``-th batch of ``P`` prompts, so a streaming run and a step-by-step
one see the prompts in the same order)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from realign.algorithms.params import DAPOConfig
from realign.data.datasets import Dataset, PromptExample
from realign.data.sampler import PromptSampler
from realign.data.step_batch import prompts_record
from realign.run.ops import Call
from realign.run.stream_parts import stream_parts, stream_settings
from realign.runtime.settings import SamplingParams
from realign.worker.records import Record
from realign.worker.runner import StepRunner
from realign.worker.stream_worker import GroupPrompts, StreamGenerator, StreamTrainer

if TYPE_CHECKING:
    from realign.worker.session import Session


def group_prompts(dataset: Dataset, per_step: int, pad: int) -> GroupPrompts:
    """The prompts record of groups (by id) as :func:`realign.data.step_batch.step_batch`
    orders the training data."""
    batches: dict[int, list[PromptExample]] = {}

    def example(gid: int) -> PromptExample:
        step, row = divmod(gid, per_step)
        if step not in batches:
            c = dataset.config
            sampler = PromptSampler(len(dataset), per_step, seed=c.seed, shuffle=c.shuffle)
            sampler.consumed = step * per_step
            if len(batches) > 8:
                batches.clear()
            batches[step] = cast(list[PromptExample], dataset.take(sampler.next_batch()))
        return batches[step][row]

    def prompts_of(gids: list[int]) -> Record:
        return prompts_record([example(g) for g in gids], pad)
    return prompts_of


class StreamSide:
    """This worker's side of the stream: ``step``, and ``state``/``load`` for
    checkpoints (the generator's; the training side keeps none beyond its weights)."""

    def __init__(self, session: Session):
        cfg, spec = session.cfg, session.spec
        parts = stream_parts(session.program)
        a = cfg.algorithm
        shape = a.shape()
        group_size = parts.gen.mfc.n_seqs // shape.prompts_generated
        train = next(op for op in parts.train.ops
                     if isinstance(op, Call) and op.kind == "train" and op.role == "actor")
        batch_groups = train.mfc.n_seqs // group_size
        # ReMax: the greedy baseline of each group is one more sample of it
        greedy = parts.greedy.mfc.n_seqs // batch_groups if parts.greedy is not None else 0
        settings = stream_settings(spec.plan, parts, group_size + greedy, batch_groups,
                                   a.max_staleness, cfg.rollout.on_update)
        self.settings = settings
        self.session = session
        self.generator: StreamGenerator | None = None
        self.trainer: StreamTrainer | None = None
        if session.rank == parts.gen_rank:
            eos = session.tokenizer.eos_token_id
            sampling = SamplingParams(
                **cfg.sampling.model_dump(), max_new_tokens=parts.gen.mfc.gen_len,
                greedy=parts.gen.mfc.greedy,
                stop_token_ids=(eos,) if eos is not None else (),
                seed=cfg.run.seed * 1_000_003)
            self.generator = StreamGenerator(
                parts, settings, session.runner, session.calls,
                group_prompts(session.dataset, shape.prompts_generated, session.pad),
                sampling, a.prompt_len, spec.steps, session.pad,
                drop_constant=isinstance(a.params, DAPOConfig) and a.params.dynamic_sampling)
        else:
            runner = StepRunner(parts.train, session.hosted, session.calls, session.rank,
                                session.dev.device, session.dev.dtype,
                                spec.plan.cluster.gpus_per_node, loras=session.loras)
            runner.position = session.runner.position
            self.trainer = StreamTrainer(parts, runner, spec.steps)

    def step(self, step: int) -> Any:
        if self.generator is not None:
            return self.generator.step(step)
        assert self.trainer is not None
        s = self.session
        return self.trainer.step(step, s.dataset_record(step), s.evaluates_at(step))

    def state(self) -> dict[str, Any]:
        return self.generator.state() if self.generator is not None else {}

    def load(self, st: dict[str, Any] | None) -> None:
        if self.generator is not None and st:
            self.generator.load(st)
