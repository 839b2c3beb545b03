"""A worker's execution of one step: walk the program's ops in order, take part in
those that name this rank, skip the rest (so disjoint meshes run concurrently).

What an op does on a member rank:
* ``Realloc``: refill the destination copy from the trained copy (executor, bytes
  exactly the plan's: a different count is an error), restoring its storage first if
  it was released;
* ``Send``: the record goes from its holder to each rank lacking it, point to point;
* ``Call``: generate / inference / train on the replica, reading and writing records;
* ``RuleReward``: score generated text with the reward function;
* ``Release``: free a reallocated copy's storage after its last use.
Asynchronous programs: a ``Call`` or ``RuleReward`` marked ``ahead`` works on the
next step's batch (its own store); what it makes stays on its ranks as the *carried*
rollout, which the next step reads (and a checkpoint saves: the samples in flight).
Its metrics describe that rollout, so they are reported with the step that trains on
it.
The first rank of each op reports its metrics to the controller; metrics that differ
between data-parallel ranks (a train call's loss) come from every DP rank as
``dp_parts`` and the controller averages them (no collective in the step for it).
Every rank records when it started and ended each of its ops (wall clock, ``spans``),
and the first rank names the op (``ops``): the controller takes an op's duration from
its last rank's start to its last rank's end (:func:`realign.controller.step_report.
merge_metrics`), so a rank that arrives early and waits for its peers does not count
the wait as the op's time. Each op entered and left is noted in ``position``, which the
worker's heartbeats carry (:mod:`realign.worker.watchdog`).
"""
from __future__ import annotations

import sys
import time
from typing import TypedDict, assert_never

import torch

from planner.specs.lora import LoraSpec
from realign.realloc import offload
from realign.run.ops import Call, Evaluate, Op, Realloc, Release, RuleReward, Send
from realign.run.program import Program
from realign.runtime.realloc_glue import reallocate_replica, release_copy
from realign.worker.records import Record, recv_record, send_record
from realign.worker.replicas import Hosted, head_of
from realign.worker.sampling_loop import SamplingLoop, merge_round_metrics
from realign.worker.watchdog import STALL_ENV, Position


class StepReport(TypedDict):
    """One rank's report of a step (:func:`realign.controller.step_report.merge_metrics`)."""

    metrics: dict[str, float]
    dp_parts: dict[str, float]
    ops: list[list[object]]      #: ``[index, label, detail, ranks, timed metric]`` (first rank)
    spans: list[list[object]]    #: ``[index, wall start, wall end]`` of each op


class StepRunner:
    """Runs the program's ops; MFC semantics come from ``calls`` (see calls.py)."""

    def __init__(self, program: Program, hosted: dict[str, Hosted], calls, rank: int,
                 device: torch.device, dtype: torch.dtype, gpus_per_node: int,
                 loras: dict[str, LoraSpec] | None = None):
        self.program, self.hosted, self.calls = program, hosted, calls
        self.rank, self.device, self.dtype, self.gpn = rank, device, dtype, gpus_per_node
        #: LoRA settings by role: their reallocations move only the adapters
        self.loras = loras or {}
        #: the rollout made ahead for the next step (records, and its metrics)
        self.carried: dict[str, Record] = {}
        self.carried_metrics: dict[str, float] = {}
        #: where this rank is, for the heartbeats (realign.worker.watchdog)
        self.position = Position()
        #: the test-only stall (rank, call, seconds, from step) of watchdog.STALL_ENV, once
        self.stall: tuple[int, str, float, int] | None = None

    def run(self, step: int, dataset: dict[str, Record], evaluate: bool = False,
            next_dataset: dict[str, Record] | None = None, prologue: bool = False,
            rounds: SamplingLoop | None = None) -> StepReport:
        """``{"metrics": ..., "dp_parts": ...}``: this rank's report of the step (see
        :func:`realign.controller.step_report.merge_metrics`); ``evaluate``: the step ends
        with the evaluation's ops. Asynchronous programs: ``next_dataset`` is the next
        step's batch (None on the last step: nothing is made ahead); ``prologue``: no
        rollout was made ahead for this step, so it is generated first. ``rounds``:
        DAPO's sampling rounds of this step (the program's span runs again while the
        batch is short)."""
        store: dict[str, Record] = dict(dataset)
        store.update(self.carried)
        metrics: dict[str, float] = dict(self.carried_metrics)
        ahead: dict[str, Record] = dict(next_dataset or {})
        ahead_metrics: dict[str, float] = {}
        self.carried, self.carried_metrics = {}, {}
        dp_parts: dict[str, float] = {}
        ops: list[list[object]] = []
        spans: list[list[object]] = []
        me = self.rank
        plan_ops = self.program.ops_for(evaluate, prologue=prologue, last=next_dataset is None)
        walk = rounds.walk(plan_ops, store, metrics) if rounds else enumerate(plan_ops)
        for i, op in walk:
            again = rounds is not None and rounds.round > 0
            if me not in op.ranks:
                continue
            lead = me == op.ranks[0]
            wall0 = time.time()
            t0 = time.perf_counter()
            self.position.enter(step, i, describe(op)[0], op)
            match op:
                case Realloc():
                    stats = self._realloc(op)
                    metrics[f"realloc_bytes.{op.to_mfc}.r{me}"] = float(stats.bytes_received)
                case Send():
                    self._send(op, store)
                case Call():
                    self._maybe_stall(op, step)
                    where, mine = (ahead, ahead_metrics) if op.ahead else (store, metrics)
                    out, m, parts = self.calls.call(op, self.hosted[op.replica], where, step,
                                                    sampling_round=rounds.round if rounds else 0)
                    where.update(out)
                    dp_parts.update(parts)
                    if lead:
                        merge_round_metrics(mine, m) if again else mine.update(m)
                case RuleReward():
                    where, mine = (ahead, ahead_metrics) if op.ahead else (store, metrics)
                    out, m = self.calls.rule_reward(op, where, step + op.ahead)
                    where.update(out)
                    if lead:
                        merge_round_metrics(mine, m) if again else mine.update(m)
                case Evaluate():
                    m = self.calls.evaluate(op, store, step)
                    if lead:
                        metrics.update(m)
                case Release():
                    h = self.hosted[op.replica]
                    h.released = release_copy(h.shard)
                case _:
                    assert_never(op)
            self.position.leave()
            if not isinstance(op, Release):
                spans.append([i, wall0, wall0 + time.perf_counter() - t0])
                if lead:
                    label, metric = describe(op)[0], timed_metric(op)
                    if rounds is not None:
                        label, metric = rounds.tag(label, metric)
                    ops.append([i, label, describe(op)[1], list(op.ranks), metric])
        self.carried = {k: v for k, v in ahead.items() if k not in (next_dataset or {})}
        self.carried_metrics = ahead_metrics
        return {"metrics": metrics, "dp_parts": dp_parts, "ops": ops, "spans": spans}

    def _maybe_stall(self, op: Call, step: int) -> None:
        st = self.stall
        if st is not None and st[:2] == (self.rank, op.name) and step >= st[3]:
            self.stall = None
            print(f"{STALL_ENV}: rank {self.rank} stalls {st[2]:g} s in {op.name} at step "
                  f"{step}", file=sys.stderr, flush=True)
            time.sleep(st[2])

    def _realloc(self, op: Realloc):
        src, dst = self.hosted[op.src], self.hosted[op.dst]
        if dst.released is not None:
            offload.restore(dst.released)
            dst.released = None
        spec, head = self.calls.specs[op.role], head_of(src.replica)
        return reallocate_replica(spec, head, src.groups, dst.groups, src.shard, dst.shard,
                                  dtype=self.dtype, gpus_per_node=self.gpn,
                                  planned=(op.bytes, op.dtype_bytes),
                                  lora=self.loras.get(op.role))

    def _send(self, op: Send, store: dict[str, Record]) -> None:
        me = self.rank
        if me in op.dst_ranks:
            store[op.key] = recv_record(op.sender_of(me))
        if me in op.src_ranks:
            for d in op.dst_ranks:
                if op.sender_of(d) == me:
                    send_record(store[op.key], d)


def timed_metric(op: Op) -> str | None:
    """The metric an op's duration is reported under: ``time.<mfc>`` for a call,
    ``time.realloc.<mfc>`` for the reallocation before it, none for the others."""
    match op:
        case Call():
            return f"time.{op.name}"   # an ahead call's time: the step it runs in
        case Realloc():
            return f"time.realloc.{op.to_mfc}"
        case Send() | RuleReward() | Evaluate() | Release():
            return None
        case _:
            assert_never(op)


def describe(op: Op) -> tuple[str, str]:
    """(label, kind) of an op on a timeline."""
    match op:
        case Call():
            return (f"{op.name} (next step)" if op.ahead else op.name), op.kind
        case Realloc():
            return f"realloc {op.role} -> {op.to_mfc}", "realloc"
        case Send():
            return f"send {op.key}", "send"
        case RuleReward():
            return f"reward {op.out_key}", "reward"
        case Release():
            return f"release {op.replica}", "release"
        case Evaluate():
            return f"evaluate {op.name}", "eval"
        case _:
            assert_never(op)
