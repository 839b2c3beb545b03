"""A streaming run's step on each side (``rollout.mode: streaming``, docs/async.md).

The generator (the rollout call's GPU) decodes continuously in slots that refill
(:class:`~realign.runtime.engines.stream_decode.StreamDecoder`), driven iteration by
iteration by the stream's deterministic schedule
(:class:`planner.graph.streaming.StreamSchedule`, its online form): the schedule admits
samples in data order (``group_size`` per prompt, the prompts in the order of the
training data), the decoder reports which ended, finished groups enter the rollout
buffer, and the schedule says when the trainer takes a batch (no more than
``max_staleness`` versions old; older groups are dropped and counted) and at which
iteration its update reaches the generator (the take's iteration plus ``train_iters``).

The messages between the two sides alternate, so neither can deadlock: the initial
weights, batch 0, update 1, batch 1, update 2, ... A batch the schedule takes before
the update due ahead of it has been applied waits on the generator until then. The
weights move with the plan's reallocation into the generator's copy, between two
decode iterations (the generator pauses; docs/async.md says why not a double buffer);
with ``on_update: continue`` the cache of the sequences in flight is then recomputed
from their tokens, with ``finish`` the schedule first lets them end (admitting none),
and the training side waits in the copy meanwhile.

A step of the controller is, on the training side: receive batch ``k``, run the
program's other ops on it (scoring, training), then send update ``k + 1`` (not after
the last step); on the generator: decode until batch ``k`` is sent and update
``k + 1`` applied. So the generator decodes while the trainer trains, and both reach
the end of a step at the same copy. What the wall clock does not decide: which samples
each batch holds, their versions and tokens (the schedule counts iterations, and
whichever side is early waits), so a run repeats exactly.

ReMax (``parts.greedy``): each group's last sample is its greedy baseline, decoded
greedily in the same slots (:meth:`StreamGenerator._greedy`) and sent as the greedy
call's records beside the group's.

DAPO's dynamic sampling (``drop_constant``): as each group finishes, the generator
scores it with the rule reward it streams (``rewards``) and tells the schedule whether
its rewards are all equal; such a group is dropped at the buffer and counted
(``stream.dropped_constant``), never sent nor trained, and the generator keeps
admitting the next prompts until a batch of the others is there. The batch it sends
is marked :data:`~realign.algorithms.selection.KEPT_INFORMATIVE`, so DAPO's
``prepare`` trains it whole. The rule reward is a function of the answer, so the
batch's rewards, scored again when it is sent, are those the buffer judged.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from planner.graph.streaming import ConstantLengths, StepRecord, StreamSchedule, StreamSettings
from realign.algorithms.selection import KEPT_INFORMATIVE, constant_groups
from realign.errors import UserError
from realign.run.stream_parts import StreamParts
from realign.runtime.engines.stream_decode import StreamDecoder, StreamedSample
from realign.runtime.sampling import SamplingParams
from realign.worker.records import Record, recv_record, send_record, sequences_from_generation
from realign.worker.runner import StepReport, StepRunner

#: DAPO's constant groups dropped while a batch fills, in batches, past which the run
#: stops (the rewards teach nothing: a share of 0.99, beyond the 0.95 a plan prices)
CONSTANT_LIMIT_BATCHES = 100

#: prompts of one group: (its token ids, the record fields of its row) by group id
GroupPrompts = Callable[[list[int]], Record]


def empty_report(metrics: dict[str, float]) -> StepReport:
    return {"metrics": metrics, "dp_parts": {}, "ops": [], "spans": []}


@dataclass
class StreamGenerator:
    """The generator's side (module docs)."""

    parts: StreamParts
    settings: StreamSettings
    runner: StepRunner               #: its reallocation executor
    calls: Any                       #: realign.worker.calls.Calls (rule rewards)
    prompts_of: GroupPrompts         #: the prompts record of groups, by group id
    sampling: SamplingParams
    max_prompt_len: int
    steps: int
    pad_id: int
    #: DAPO's dynamic sampling: drop the groups whose rewards are all equal at the buffer
    drop_constant: bool = False
    schedule: StreamSchedule = field(init=False)
    decoder: StreamDecoder = field(init=False)
    ended: dict[int, StreamedSample] = field(default_factory=dict)   #: not yet trained
    taken: dict[int, StepRecord] = field(default_factory=dict)       #: by step, not yet sent
    sent: int = 0                    #: batches sent
    stats: dict[int, dict[str, float]] = field(default_factory=dict)  #: sent batches' metrics
    fresh: bool = True               #: no weights received by this process yet
    prompt_cache: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = self.settings
        shard = self.runner.hosted[self.parts.gen.replica].shard
        assert shard is not None, "the generator hosts the rollout's copy"
        # as many samples as the run reaches (dropped groups are made again), none listed
        self.schedule = StreamSchedule(s, ConstantLengths(self.sampling.max_new_tokens,
                                                          sys.maxsize))
        self.decoder = StreamDecoder(shard, s.slots, self.max_prompt_len, self.sampling,
                                     self._greedy if self.parts.greedy is not None else None)

    # ---- one controller step -------------------------------------------------------
    def step(self, step: int) -> StepReport:
        sch = self.schedule
        t0 = time.perf_counter()
        waited, iters = 0.0, 0
        if self.fresh:          # the weights of the run's start or of its checkpoint
            waited += self._update()
            self.fresh = False
        while True:
            if step in self.taken and sch.gen_version >= step and self.sent == step:
                waited += self._send(step)
            if self.sent > step and (step + 1 == self.steps or sch.gen_version > step):
                break
            it = sch.begin_iteration()
            if it.applied_update:
                waited += self._update()
                if self.settings.on_update == "continue":
                    with torch.inference_mode():
                        self.decoder.recompute()
            for i in it.admitted:
                self.decoder.admit(StreamedSample(i, self._prompt(i)))
            if it.decodes:
                ended = self.decoder.iterate(sch.gen_version)
                self.ended.update({q.sample: q for q in ended})
                sch.end_iteration({q.sample for q in ended},
                                  self._constant if self.drop_constant else None)
            rec = sch.take_iteration()
            iters += 1
            if rec is not None:
                self.taken[rec.step] = rec
            if iters > 10 ** 7:
                raise RuntimeError("the stream made no progress")
            if sch.dropped_constant > CONSTANT_LIMIT_BATCHES * self.settings.batch_groups:
                raise UserError(
                    f"step {step}: {sch.dropped_constant} groups got equal rewards for "
                    f"every sample since the last batch was taken, {CONSTANT_LIMIT_BATCHES} "
                    "batches' worth, so DAPO's "
                    "dynamic sampling (dropping them at the stream's buffer) has nothing to "
                    "train; check the reward function, or set "
                    "algorithm.params.dynamic_sampling: false", field="reward.fn")
        rec = self.taken.pop(step)
        m = dict(rec.metrics)
        m.update(self.stats.pop(step, {}))
        m["stream.generator_wait_s"] = waited
        m["stream.decode_iters"] = float(iters)
        m["stream.generator_step_s"] = time.perf_counter() - t0
        return empty_report(m)

    def _greedy(self, sample: int) -> bool:
        """ReMax: a group's last sample is its greedy baseline response."""
        g = self.settings.group_size
        return sample % g == g - 1

    def _prompt(self, sample: int) -> list[int]:
        gid = sample // self.settings.group_size
        if gid not in self.prompt_cache:
            rec = self.prompts_of([gid])
            tokens, lengths = rec["tokens"], rec["lengths"]
            assert isinstance(tokens, torch.Tensor) and isinstance(lengths, torch.Tensor)
            self.prompt_cache = {gid: tokens[0, :int(lengths[0])].tolist()}
        return self.prompt_cache[gid]

    def _update(self) -> float:
        """The trained weights into the generator's copy (the plan's reallocation)."""
        t0 = time.perf_counter()
        self.runner._realloc(self.parts.realloc)
        return time.perf_counter() - t0

    def _send(self, step: int) -> float:
        """Batch ``step``'s records to every rank of the training side."""
        rec = self.taken[step]
        records, stats = self._batch(rec, step)
        self.stats[step] = stats
        t0 = time.perf_counter()
        for r in self.parts.train_ranks:
            for key in self.parts.streamed_keys:
                send_record(records[key], r)
        self.sent += 1
        return time.perf_counter() - t0

    def _constant(self, gid: int) -> bool:
        """Group ``gid`` (all its samples ended) got one reward for every sample: its
        rule reward ``rewards`` (DAPO's judge, before the length shaping) scored here."""
        g = self.settings.group_size
        rows = [self.ended[i] for i in range(gid * g, gid * g + g)]
        seqs, _ = self._sequences(rows)
        op = next(r for r in self.parts.rewards if r.out_key == "rewards")
        records = {op.prompts_key: self.prompts_of([gid]), op.seqs_key: seqs}
        out, _ = self.calls.rule_reward(op, records, self.schedule.trainer_version)
        return bool(constant_groups(out[op.out_key][op.out_key], g, "rewards")[0])

    def _sequences(self, rows: list[StreamedSample]) -> tuple[Record, Record]:
        """(the rollout's sequences record, its log-probs record) of ``rows``."""
        n = self.sampling.max_new_tokens
        b = len(rows)
        tokens = torch.full((b, n), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros(b, n)
        versions = torch.full((b, n), -1, dtype=torch.long)
        lengths = torch.tensor([len(q.tokens) for q in rows], dtype=torch.long)
        for r, q in enumerate(rows):
            k = len(q.tokens)
            tokens[r, :k] = torch.tensor(q.tokens)
            logprobs[r, :k] = torch.tensor(q.logprobs)
            versions[r, :k] = torch.tensor(q.versions)
        prompts = [q.prompt for q in rows]
        seqs, lps = sequences_from_generation(prompts, tokens, logprobs, lengths, self.pad_id)
        seqs["token_versions"] = versions
        return seqs, lps

    def _batch(self, rec: StepRecord, step: int) -> tuple[dict[str, Record], dict[str, float]]:
        """The taken groups' samples as the rollout call's records, with their rule
        rewards; the samples of groups dropped (too stale, or constant) are forgotten."""
        g = self.settings.group_size
        every = [self.ended.pop(i) for gid in rec.group_ids for i in range(gid * g, gid * g + g)]
        self._forget()
        greedy_call = self.parts.greedy
        # ReMax: each group's last sample is its greedy baseline, streamed on its own
        rows = every if greedy_call is None else [q for q in every if not self._greedy(q.sample)]
        seqs, lps = self._sequences(rows)
        lengths = torch.tensor([len(q.tokens) for q in rows], dtype=torch.long)
        # a group's version is its oldest token's (the schedule's staleness)
        oldest: dict[int, int] = {}
        for q in every:
            gid = q.sample // g
            oldest[gid] = min(oldest.get(gid, q.versions[0]), *q.versions)
        seqs["policy_version"] = torch.tensor([oldest[q.sample // g] for q in rows])
        if self.drop_constant:
            seqs[KEPT_INFORMATIVE] = torch.ones(len(rows), dtype=torch.bool)
        gen = self.parts.gen
        records: dict[str, Record] = {gen.inputs[0]: self.prompts_of(list(rec.group_ids)),
                                      gen.outputs[0]: seqs}
        if len(gen.outputs) > 1:
            records[gen.outputs[1]] = lps
        if greedy_call is not None:
            records[greedy_call.outputs[0]] = self._sequences(
                [q for q in every if self._greedy(q.sample)])[0]
        stats = {"gen_tokens": float(lengths.sum()),
                 "response_len": float(lengths.float().mean()),
                 "stream.staleness_max": float(step - min(oldest.values())),
                 "stream.token_version_span": float(max(len(set(q.versions)) for q in every))}
        for op in self.parts.rewards:
            out, m = self.calls.rule_reward(op, records, step)
            records.update(out)
            stats.update(m)
        return records, stats

    def _forget(self) -> None:
        """Drop the ended samples of groups that left the stream untrained (dropped as
        too stale or constant): neither in the buffer, nor decoding, nor in a batch not yet sent."""
        sch, g = self.schedule, self.settings.group_size
        assert sch.buffer is not None
        live = ({x.group_id for x in sch.buffer.groups} | set(sch.done_samples)
                | {sl.sample // g for sl in sch.slots}
                | {gid for r in self.taken.values() for gid in r.group_ids})
        for i in [i for i in self.ended if i // g not in live]:
            del self.ended[i]

    # ---- checkpoints -----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The schedule (buffer and slots), the samples in flight and those ended but
        not yet trained, the batches taken and not yet sent (plain values)."""
        return {"schedule": self.schedule.state(),
                "decoder": self.decoder.state(),
                "ended": [q.state() for q in self.ended.values()],
                "taken": {str(k): [r.step, r.take_iter, list(r.group_ids), r.metrics]
                          for k, r in self.taken.items()},
                "sent": self.sent}

    def load(self, st: dict[str, Any]) -> None:
        self.schedule = StreamSchedule.from_state(self.settings, self.schedule.lengths,
                                                  st["schedule"])
        self.decoder.load(st["decoder"])
        self.ended = {int(q[0]): StreamedSample.from_state(q) for q in st["ended"]}
        self.taken = {int(k): StepRecord(a, b, tuple(c), d) for k, (a, b, c, d)
                      in st["taken"].items()}
        self.sent = int(st["sent"])


@dataclass
class StreamTrainer:
    """The training side's step (module docs): its runner runs ``parts.train``."""

    parts: StreamParts
    runner: StepRunner               #: over the training side's program
    steps: int
    fresh: bool = True               #: no weights sent by this process yet

    def step(self, step: int, dataset: dict[str, Record], evaluate: bool) -> StepReport:
        me = self.runner.rank
        t0 = time.perf_counter()
        if self.fresh and me in self.parts.realloc.ranks:
            self.runner._realloc(self.parts.realloc)      # the start's or checkpoint's
        self.fresh = False
        got = {key: recv_record(self.parts.gen_rank) for key in self.parts.streamed_keys}
        waited = time.perf_counter() - t0
        report = self.runner.run(step, {**dataset, **got}, evaluate)
        if step + 1 < self.steps and me in self.parts.realloc.ranks:
            t1 = time.perf_counter()
            self.runner._realloc(self.parts.realloc)
            waited += time.perf_counter() - t1
        if me == self.parts.train_ranks[0]:
            report["metrics"]["stream.trainer_wait_s"] = waited
        return report
