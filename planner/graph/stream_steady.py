"""The steady state of a streaming schedule (:class:`planner.graph.streaming.StreamSchedule`)
as the planner prices it: the decode iterations between two training steps, the trained
samples' mean staleness, the share of finished groups dropped as too stale and each
side's idle share, averaged over ``steps`` steps after the buffer has filled.

A large generator (thousands of slots, responses of thousands of tokens) takes seconds
a step to simulate token by token, so the simulation may be made smaller in two ways
(:func:`sim_scale`), both ``1`` for the schedule itself:

* the clock: with a ``quantum`` of ``q`` decode iterations, every length, the training
  step and the weights' copy count in units of ``q`` iterations (rounded up, to the
  nearest and up) and the results are scaled back; a capped response spans at most
  :data:`MAX_CAP_QUANTA` units, so a length is off by less than one unit;
* the width: with a ``shrink`` of ``f``, the slots, the batch's groups and the buffer's
  capacity are divided by ``f`` (a divisor of the slots and of the batch's groups, at
  least :data:`MIN_SIM_SLOTS` slots left): the same ratio of slots to a batch, the same
  lengths, so the same iterations a step, with the tail of a batch averaged over fewer
  samples (and over the steps).

Example (constant lengths, hand-checkable): 2 groups of 4 samples a step, 8 slots,
responses of 100 tokens, no copy. Training 300 iterations: the generator makes a batch
every 100 iterations, the trainer needs 300, so a step lasts 300 iterations and the
trainer never waits. Training 50 iterations: a step lasts the generator's 100, the
trainer waits half of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from planner.graph.lengths import GenLengths
from planner.graph.streaming import StreamSchedule, StreamSettings

#: the most clock units a capped response spans (:func:`sim_scale`)
MAX_CAP_QUANTA = 256
#: the fewest slots a shrunk simulation keeps (:func:`sim_scale`)
MIN_SIM_SLOTS = 128


@dataclass(frozen=True)
class StreamEstimate:
    """A streaming schedule's averages over its steady state."""

    iters_per_step: float        #: decode iterations between two training steps
    staleness_mean: float        #: versions between a trained sample's oldest token and the trainer
    dropped_share: float         #: finished groups dropped as too stale, of all finished
    gen_idle_share: float        #: the generator decodes nothing (full buffer), copies not counted
    train_idle_share: float      #: the trainer waits for a batch


def sim_scale(settings: StreamSettings, max_len: int) -> tuple[int, int]:
    """(quantum, shrink) of a simulation (the module docs): decode iterations per unit,
    a capped response spanning at most :data:`MAX_CAP_QUANTA` units; the largest divisor
    of both the slots and the batch's groups that leaves :data:`MIN_SIM_SLOTS` slots.

    Example: a cap of 3840 tokens, 2048 slots, 256 groups a step -> (15, 16): 128 slots,
    16 groups; a cap of 240, 8 slots -> (1, 1)."""
    quantum = max(1, math.ceil(max_len / MAX_CAP_QUANTA))
    common = math.gcd(settings.slots, settings.batch_groups)
    if settings.capacity_groups is not None:
        common = math.gcd(common, settings.capacity_groups)
    shrink = max((f for f in range(1, common + 1)
                  if common % f == 0 and settings.slots // f >= MIN_SIM_SLOTS), default=1)
    return quantum, shrink


def draw_stream_lengths(lengths: GenLengths | None, max_len: int, n: int, seed: int
                        ) -> list[int]:
    """``n`` response lengths drawn from ``lengths`` (seeded), or all ``max_len`` where
    the experiment gives no distribution (every response runs to the cap)."""
    if lengths is None:
        return [max_len] * n
    rng = np.random.default_rng(seed)
    p = np.asarray(lengths.pmf(), dtype=float)
    return [int(x) for x in rng.choice(np.arange(1, len(p) + 1), size=n, p=p / p.sum())]


def lengths_needed(settings: StreamSettings, steps: int, constant_share: float = 0.0) -> int:
    """Samples a simulation of ``steps`` measured steps may draw: the warm-up's and the
    measured steps' batches (over ``1 - constant_share``: DAPO's constant groups are
    made and dropped), what the buffer and the slots hold ahead, and the stale."""
    batch = math.ceil(settings.group_size * settings.batch_groups / (1 - constant_share))
    ahead = settings.capacity() * settings.group_size + settings.slots
    return (warmup_steps(settings) + steps + 1) * batch * 2 + ahead


def warmup_steps(settings: StreamSettings) -> int:
    """Steps left out of the averages: until the buffer has filled to its bound."""
    return settings.max_staleness + 2


def scaled_schedule(settings: StreamSettings, lengths: list[int], quantum: int = 1,
                    shrink: int = 1, constant_share: float = 0.0) -> StreamSchedule:
    """The schedule on a clock of ``quantum`` decode iterations a unit, ``shrink`` times
    narrower (:func:`sim_scale`); its iterations times ``quantum`` are decode iterations.
    ``constant_share``: DAPO's groups dropped at the buffer as constant
    (:func:`planner.graph.streaming.drawn_constant`)."""
    assert quantum >= 1 and shrink >= 1
    q, f = quantum, shrink
    assert settings.slots % f == 0 and settings.batch_groups % f == 0, (settings, f)
    cap = settings.capacity_groups
    coarse = replace(settings, train_iters=round(settings.train_iters / q),
                     update_iters=math.ceil(settings.update_iters / q),
                     slots=settings.slots // f, batch_groups=settings.batch_groups // f,
                     capacity_groups=None if cap is None else max(1, cap // f))
    return StreamSchedule(coarse, [math.ceil(max(1, n) / q) for n in lengths],
                          constant_share=constant_share)


def steady_stream(settings: StreamSettings, lengths: list[int], steps: int,
                  quantum: int = 1, shrink: int = 1, constant_share: float = 0.0
                  ) -> StreamEstimate:
    """Run the schedule for :func:`warmup_steps` and then ``steps`` steps on a clock of
    ``quantum`` decode iterations a unit, ``shrink`` times narrower (:func:`sim_scale`),
    a share ``constant_share`` of the finished groups dropped as constant (DAPO), and
    average the measured steps (``dropped_share``: the stale groups only)."""
    assert steps >= 1
    q = quantum
    sch = scaled_schedule(settings, lengths, quantum, shrink, constant_share)
    warm = warmup_steps(settings)
    recs = sch.run_steps(warm + steps)
    body = recs[warm:]
    span = max(1, recs[-1].take_iter - recs[warm - 1].take_iter)
    trained = steps * sch.settings.batch_groups        # the narrowed batch, as dropped
    dropped = sum(r.metrics["stream.dropped_stale"] for r in body)
    return StreamEstimate(
        iters_per_step=span * q / steps,
        staleness_mean=sum(r.metrics["stream.staleness_mean"] for r in body) / steps,
        dropped_share=dropped / (dropped + trained),
        gen_idle_share=min(1.0, sum(r.metrics["stream.generator_idle_iters"]
                                    for r in body) / span),
        train_idle_share=min(1.0, sum(r.metrics["stream.trainer_idle_iters"]
                                      for r in body) / span))
