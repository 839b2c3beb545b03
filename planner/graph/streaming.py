"""The deterministic schedule of streaming generation (``rollout.mode: streaming``),
simulated on the generator's clock: its decode iterations.

A generator with ``slots`` slots decodes continuously on its own GPUs: each free slot
takes the next waiting sample (samples in data order, ``group_size`` per prompt), each
iteration adds one token to every busy slot, and a group whose samples have all ended
goes into the :class:`~planner.graph.stream_buffer.RolloutBuffer`. A group may begin
only while the buffer's groups and those decoding stay within its capacity; otherwise
the generator idles. The trainer takes ``batch_groups`` groups as soon as that many
are there, no more than ``max_staleness`` versions old (older ones are dropped and
counted), and trains for ``train_iters`` iterations of the generator's clock.

What makes it deterministic: the trainer's update from a batch taken at iteration
``t`` reaches the generator at iteration ``t + train_iters`` exactly, whatever the
wall clock says (a generator that gets there first waits for it, a copy that arrives
early waits for that iteration). The generator then pauses ``update_iters`` iterations
(the weights' copy, between two decode iterations) and applies it:

* ``on_update: continue`` — the sequences in flight continue under the new weights
  (their KV cache recomputed from their tokens), so one sample's tokens may come from
  several versions: each token keeps the version it was generated with (and its
  behaviour log-prob), and a group's staleness is its oldest token's;
* ``on_update: finish`` — no new sample begins until those in flight have ended under
  the weights they began with; then the copy.

DAPO's dynamic sampling in the stream: a finished group whose rewards are all equal
(it teaches nothing) does not enter the buffer; it is counted
(``stream.dropped_constant``) and never trained, and the generator keeps admitting the
next prompts until a batch of the others is there. The runtime says which groups are
constant (:meth:`StreamSchedule.end_iteration`'s ``constant``: their rule rewards);
the planner's simulation drops a share ``constant_share`` of them
(:func:`drawn_constant`: the ``dropped_group_frac`` the synchronous plan prices), so
the extra generation is priced.

Within an iteration the order is fixed: an update due at it is applied, the
generator decodes, finished groups enter the buffer (by group id), the trainer takes.
Lengths come from a list (a seeded draw: :func:`draw_lengths`), so the same settings
give the same samples, versions and batches, and a run resumed from :meth:`
StreamSchedule.state` repeats an uninterrupted one exactly.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import numpy as np

from planner.graph.stream_buffer import FinishedGroup, RolloutBuffer, staleness_metrics

OnUpdate = Literal["continue", "finish"]


@dataclass(frozen=True)
class StreamSettings:
    """The numbers of a streaming schedule, all on the generator's clock."""

    group_size: int          #: samples per prompt
    batch_groups: int        #: groups a training step takes
    slots: int               #: samples decoding at once
    train_iters: int         #: a training step, in generator decode iterations
    update_iters: int        #: the weights' copy: the generator's pause
    max_staleness: int       #: algorithm.max_staleness (>= 1)
    on_update: OnUpdate = "continue"
    capacity_groups: int | None = None   #: None: (max_staleness + 1) * batch_groups

    def capacity(self) -> int:
        return self.capacity_groups or (self.max_staleness + 1) * self.batch_groups


@dataclass
class _Slot:
    sample: int                          #: its index in data order
    left: int                            #: tokens still to generate
    segments: list[list[int]]            #: [version, tokens] in order


@dataclass(frozen=True)
class Iteration:
    """What :meth:`StreamSchedule.begin_iteration` tells the runtime."""

    applied_update: bool           #: the generator's version just went up by one
    admitted: tuple[int, ...]      #: samples (data order) that took a free slot
    decodes: bool                  #: the slots decode one token this iteration


@dataclass
class StepRecord:
    """One training step of the schedule: its metrics (``metrics.jsonl``'s ``stream.*``)
    and the groups it trained."""

    step: int
    take_iter: int
    group_ids: tuple[int, ...]
    metrics: dict[str, float]


class ConstantLengths(Sequence[int]):
    """``n`` samples of one ``length`` without a list of them: the runtime's schedule,
    whose samples end at their decode's end token (the length is only their cap) and
    whose count is not known ahead (groups dropped as stale are made again)."""

    def __init__(self, length: int, n: int):
        self.length, self.n = length, n

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return [self.length] * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.length


@dataclass
class StreamSchedule:
    settings: StreamSettings
    lengths: Sequence[int]               #: response length of each sample, data order
    it: int = 0                          #: the generator's next decode iteration
    next_sample: int = 0
    gen_version: int = 0
    pause_left: int = 0                  #: iterations of a copy still to wait
    draining: bool = False               #: finish: an update waits for the slots to empty
    slots: list[_Slot] = field(default_factory=list)
    done_samples: dict[int, list[int]] = field(default_factory=dict)  #: ended, by unfinished group
    buffer: RolloutBuffer | None = None
    trainer_version: int = 0
    updates: list[int] = field(default_factory=list)   #: iterations the next updates arrive
    trainer_busy_until: int | None = None
    gen_idle: int = 0                    #: since the last take
    gen_copy: int = 0
    trainer_idle: int = 0
    pending_dropped: int = 0             #: dropped while no batch was ready
    dropped_constant: int = 0            #: constant groups dropped since the last take
    #: the simulation's share of constant groups (:func:`drawn_constant`); the runtime
    #: says which groups are constant itself (:meth:`end_iteration`)
    constant_share: float = 0.0
    #: each finished sample's [version, tokens] segments (what the runtime records per
    #: token), held until its group enters the buffer
    segments: dict[int, list[list[int]]] = field(default_factory=dict)
    #: keep every finished sample's segments (tests read them); the runtime keeps only
    #: those of groups not yet in the buffer, so a checkpoint stays bounded
    keep_segments: bool = False

    def __post_init__(self) -> None:
        s = self.settings
        assert s.max_staleness >= 1 and s.slots >= 1 and s.batch_groups >= 1
        if self.buffer is None:
            self.buffer = RolloutBuffer(s.capacity())

    # ---- one iteration ---------------------------------------------------------
    def _in_flight_groups(self) -> int:
        return len({sl.sample // self.settings.group_size for sl in self.slots})

    def _generator(self) -> None:
        """One iteration of the list-of-lengths simulation: :meth:`begin_iteration`,
        then the slots whose sample has generated its ``lengths`` entry end."""
        if self.begin_iteration().decodes:
            share = self.constant_share
            self.end_iteration({sl.sample for sl in self.slots if sl.left == 1},
                               (lambda gid: drawn_constant(gid, share)) if share else None)

    # ---- the online form: one iteration fed by the real end-of-sequence events ------
    def begin_iteration(self) -> Iteration:
        """The generator's side of iteration :attr:`it` up to its decode: an update due
        is applied (``on_update: finish``: once the slots have drained), a copy's pause
        is counted, free slots take the next samples. The runtime then decodes one
        token for every slot in :attr:`slots` and reports which samples ended to
        :meth:`end_iteration` (only when :attr:`Iteration.decodes`)."""
        s, buf = self.settings, self.buffer
        assert buf is not None
        applied = False
        if self.updates and self.updates[0] <= self.it and self.pause_left == 0:
            if s.on_update == "finish" and self.slots:
                self.draining = True
            else:
                self.updates.pop(0)
                self.draining = False
                self.gen_version += 1
                self.pause_left = s.update_iters
                applied = True
        if self.pause_left > 0:
            self.pause_left -= 1
            self.gen_copy += 1
            return Iteration(applied, (), False)
        g = s.group_size
        admitted: list[int] = []
        while not self.draining and len(self.slots) < s.slots:
            i = self.next_sample
            if i >= len(self.lengths):
                break
            if i % g == 0 and not buf.has_room(self._in_flight_groups()):
                break
            self.slots.append(_Slot(i, max(1, self.lengths[i]), []))
            admitted.append(i)
            self.next_sample += 1
        if not self.slots:
            self.gen_idle += 1
            return Iteration(applied, tuple(admitted), False)
        return Iteration(applied, tuple(admitted), True)

    def end_iteration(self, ended: set[int], constant: Callable[[int], bool] | None = None
                      ) -> tuple[int, ...]:
        """Every slot made one token under :attr:`gen_version`; the samples in
        ``ended`` have generated their last. Groups whose samples have all ended enter
        the buffer (by group id), but those ``constant`` says are constant (DAPO's
        dynamic sampling: asked once per finished group, in group order), which are
        dropped and counted; the ids of those that entered are returned."""
        buf = self.buffer
        assert buf is not None
        g = self.settings.group_size
        done = []
        for sl in self.slots:
            if sl.segments and sl.segments[-1][0] == self.gen_version:
                sl.segments[-1][1] += 1
            else:
                sl.segments.append([self.gen_version, 1])
            sl.left -= 1
            if sl.sample in ended:
                done.append(sl)
        self.slots = [sl for sl in self.slots if sl.sample not in ended]
        finished: list[int] = []
        for sl in done:
            self.segments[sl.sample] = sl.segments
            gid = sl.sample // g
            got = self.done_samples.setdefault(gid, [])
            got.append(sl.sample)
            if len(got) == g:
                finished.append(gid)
        entered = []
        for gid in sorted(finished):
            del self.done_samples[gid]
            vs = [v for i in range(gid * g, gid * g + g) for v, _ in self.segments[i]]
            if constant is not None and constant(gid):
                self.dropped_constant += 1
            else:
                buf.put(FinishedGroup(gid, min(vs), max(vs)))
                entered.append(gid)
            if not self.keep_segments:
                for i in range(gid * g, gid * g + g):
                    del self.segments[i]
        return tuple(entered)

    def take_iteration(self) -> StepRecord | None:
        """The trainer's side of iteration :attr:`it` (an update it finished, a batch it
        takes), then the clock advances: the online form's last call per iteration."""
        rec = self._trainer()
        self.it += 1
        return rec

    def _trainer(self) -> StepRecord | None:
        s, buf = self.settings, self.buffer
        assert buf is not None
        if self.trainer_busy_until is not None:
            if self.it + 1 < self.trainer_busy_until:
                return None
            self.trainer_busy_until = None
            self.trainer_version += 1
        taken = buf.take(s.batch_groups, self.trainer_version, s.max_staleness)
        if taken is None or not taken.groups:
            self.trainer_idle += 1
            if taken is not None:        # dropped, no batch: counted with the next step
                self.pending_dropped += len(taken.dropped)
            return None
        m = staleness_metrics(taken, self.trainer_version, buf.depth)
        m["stream.dropped_stale"] += self.pending_dropped
        self.pending_dropped = 0
        m.update({"stream.generator_idle_iters": float(self.gen_idle),
                  "stream.generator_copy_iters": float(self.gen_copy),
                  "stream.trainer_idle_iters": float(self.trainer_idle),
                  "stream.dropped_constant": float(self.dropped_constant)})
        self.gen_idle = self.gen_copy = self.trainer_idle = self.dropped_constant = 0
        end = self.it + 1 + s.train_iters
        self.trainer_busy_until = end
        self.updates.append(end)
        return StepRecord(self.trainer_version, self.it,
                          tuple(g.group_id for g in taken.groups), m)

    def run_steps(self, n_steps: int, max_iters: int = 10 ** 7) -> list[StepRecord]:
        """Advance until ``n_steps`` more batches have been taken; their records."""
        out: list[StepRecord] = []
        start = self.it
        while len(out) < n_steps:
            if self.it - start > max_iters:
                raise RuntimeError("streaming schedule made no progress (lengths run out?)")
            self._generator()
            rec = self._trainer()
            self.it += 1
            if rec is not None:
                out.append(rec)
        return out

    # ---- checkpoints -------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything the schedule holds, as plain JSON values (the buffer and the
        sequences in flight included)."""
        assert self.buffer is not None
        return {
            "it": self.it, "next_sample": self.next_sample, "gen_version": self.gen_version,
            "pause_left": self.pause_left, "draining": self.draining,
            "slots": [[sl.sample, sl.left, sl.segments] for sl in self.slots],
            "done_samples": {str(k): v for k, v in self.done_samples.items()},
            "buffer": self.buffer.state(), "trainer_version": self.trainer_version,
            "updates": list(self.updates), "trainer_busy_until": self.trainer_busy_until,
            "gen_idle": self.gen_idle, "gen_copy": self.gen_copy,
            "trainer_idle": self.trainer_idle,
            "pending_dropped": self.pending_dropped,
            "dropped_constant": self.dropped_constant,
            "segments": {str(k): v for k, v in self.segments.items()}}

    @classmethod
    def from_state(cls, settings: StreamSettings, lengths: Sequence[int], st: dict[str, Any]
                   ) -> StreamSchedule:
        sch = cls(settings, lengths, it=st["it"], next_sample=st["next_sample"],
                  gen_version=st["gen_version"], pause_left=st["pause_left"],
                  draining=st["draining"],
                  slots=[_Slot(a, b, [list(x) for x in c]) for a, b, c in st["slots"]],
                  done_samples={int(k): v for k, v in st["done_samples"].items()},
                  buffer=RolloutBuffer.from_state(st["buffer"]),
                  trainer_version=st["trainer_version"], updates=list(st["updates"]),
                  trainer_busy_until=st["trainer_busy_until"], gen_idle=st["gen_idle"],
                  gen_copy=st["gen_copy"], trainer_idle=st["trainer_idle"],
                  pending_dropped=st["pending_dropped"],
                  dropped_constant=st["dropped_constant"],
                  segments={int(k): [list(x) for x in v] for k, v in st["segments"].items()})
        return sch


def drawn_constant(group_id: int, share: float) -> bool:
    """Whether the simulation takes group ``group_id`` as constant when a ``share`` of
    the groups is: evenly spaced, so any run of groups holds that share to within one
    (no seed: the lengths' draw already varies the schedule).

    Example: share 0.25 -> groups 3, 7, 11, ... are constant; 0.5 -> 1, 3, 5, ..."""
    return math.floor((group_id + 1) * share + 1e-9) > math.floor(group_id * share + 1e-9)


def draw_lengths(mean: float, cap: int, n: int, seed: int) -> list[int]:
    """``n`` response lengths stopping at an end token with probability ``1 / mean``
    per token, at most ``cap`` (the long tail of reasoning RL), seeded."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.minimum(rng.geometric(1.0 / max(mean, 1.0), size=n), cap)]


def synchronous_iters(settings: StreamSettings, lengths: list[int], steps: int) -> int:
    """Iterations the same work takes step by step on the same clock: each step
    generates its batch in the slots (refilling), then trains, then copies the
    weights; nothing overlaps."""
    g, b = settings.group_size, settings.batch_groups
    total = 0
    for k in range(steps):
        rows = lengths[k * g * b:(k + 1) * g * b]
        ends = [0] * min(settings.slots, len(rows))
        for n in rows:                          # each row to the slot freed first
            j = ends.index(min(ends))
            ends[j] += max(1, n)
        total += max(ends) + settings.train_iters + settings.update_iters
    return total


@dataclass(frozen=True)
class SteadyState:
    """The schedule's averages over its steps (what ``realign plan`` would print)."""

    iters_per_step: float
    staleness_mean: float
    dropped_per_step: float
    generator_idle_share: float
    trainer_idle_share: float
    speedup_vs_synchronous: float


def steady_state(settings: StreamSettings, lengths: list[int], steps: int) -> SteadyState:
    """Run the schedule for ``steps`` steps (after one warm-up step) and average."""
    sch = StreamSchedule(settings, lengths)
    recs = sch.run_steps(steps + 1)
    span = max(1, recs[-1].take_iter - recs[0].take_iter)
    body = recs[1:]
    gen_idle = sum(r.metrics["stream.generator_idle_iters"] for r in body)
    tr_idle = sum(r.metrics["stream.trainer_idle_iters"] for r in body)
    sync = synchronous_iters(settings, lengths, steps)
    return SteadyState(
        iters_per_step=span / steps,
        staleness_mean=sum(r.metrics["stream.staleness_mean"] for r in body) / steps,
        dropped_per_step=sum(r.metrics["stream.dropped_stale"] for r in body) / steps,
        generator_idle_share=gen_idle / span, trainer_idle_share=tr_idle / span,
        speedup_vs_synchronous=(sync / steps) / (span / steps))
