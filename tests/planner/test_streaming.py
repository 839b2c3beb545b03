"""The streaming rollout buffer and its deterministic schedule (pure)."""
import json
import sys

import pytest

from planner.graph.stream_buffer import FinishedGroup, RolloutBuffer, staleness_histogram, staleness_metrics
from planner.graph.streaming import (
    ConstantLengths,
    StreamSchedule,
    StreamSettings,
    draw_lengths,
    steady_state,
    synchronous_iters,
)

pytestmark = pytest.mark.pure


def test_take_drops_groups_older_than_the_bound_and_counts_them():
    buf = RolloutBuffer(8)
    for gid, v in enumerate([0, 1, 2, 2, 3]):
        buf.put(FinishedGroup(gid, v, v))
    taken = buf.take(2, trainer_version=3, max_staleness=1)
    assert [g.group_id for g in taken.dropped] == [0, 1]      # 3 and 2 versions old
    assert [g.group_id for g in taken.groups] == [2, 3]       # oldest fresh ones first
    assert buf.depth == 1 and buf.dropped_total == 2
    m = staleness_metrics(taken, 3, buf.depth)
    assert m == {"stream.staleness_hist.1": 2.0, "stream.staleness_mean": 1.0,
                 "stream.dropped_stale": 2.0, "stream.buffer_depth": 1.0}


def test_take_waits_for_a_full_batch_and_staleness_is_the_oldest_token():
    buf = RolloutBuffer(4)
    buf.put(FinishedGroup(0, 1, 2))
    assert buf.take(2, 3, 2) is None
    assert buf.depth == 1
    assert FinishedGroup(0, 1, 2).staleness(3) == 2
    assert staleness_histogram((FinishedGroup(0, 3, 3), FinishedGroup(1, 3, 3),
                                FinishedGroup(2, 2, 3)), 4) == {1: 2, 2: 1}


def test_room_counts_groups_in_flight_and_state_round_trips():
    buf = RolloutBuffer(3)
    buf.put(FinishedGroup(0, 0, 0))
    assert buf.has_room(1) and not buf.has_room(2)
    buf.dropped_total = 5
    again = RolloutBuffer.from_state(json.loads(json.dumps(buf.state())))
    assert again == buf


def _settings(k=2, on_update="continue", **kw):
    base = dict(group_size=2, batch_groups=3, slots=4, train_iters=12, update_iters=1,
                max_staleness=k, on_update=on_update)
    base.update(kw)
    return StreamSettings(**base)


LENGTHS = draw_lengths(mean=6, cap=40, n=4000, seed=3)


@pytest.mark.parametrize("on_update", ["continue", "finish"])
def test_no_trained_group_exceeds_the_bound_and_each_is_trained_once(on_update):
    s = _settings(k=1, on_update=on_update)
    sch = StreamSchedule(s, LENGTHS)
    recs = sch.run_steps(30)
    seen = [g for r in recs for g in r.group_ids]
    assert len(seen) == len(set(seen)) == 30 * s.batch_groups
    for r in recs:
        assert all(int(k.rsplit(".", 1)[1]) <= 1
                   for k in r.metrics if k.startswith("stream.staleness_hist."))
    # a long tail at k=1: something was too stale and was dropped, never trained
    dropped = sum(r.metrics["stream.dropped_stale"] for r in recs)
    assert dropped > 0
    assert sch.buffer.dropped_total == dropped
    assert {"stream.buffer_depth", "stream.generator_idle_iters",
            "stream.trainer_idle_iters", "stream.generator_copy_iters"} <= set(recs[-1].metrics)


def test_continue_mixes_versions_within_a_sample_finish_never_does():
    cont = StreamSchedule(_settings(on_update="continue"), LENGTHS, keep_segments=True)
    cont.run_steps(20)
    fin = StreamSchedule(_settings(on_update="finish"), LENGTHS, keep_segments=True)
    fin.run_steps(20)
    assert any(len(seg) > 1 for seg in cont.segments.values())
    assert all(len(seg) == 1 for seg in fin.segments.values())
    # every token is accounted for, under one version each
    for sch in (cont, fin):
        for i, seg in sch.segments.items():
            assert sum(n for _, n in seg) == LENGTHS[i]
            assert [v for v, _ in seg] == sorted({v for v, _ in seg})


def test_updates_reach_the_generator_at_fixed_iterations():
    sch = StreamSchedule(_settings(), LENGTHS)
    recs = sch.run_steps(5)
    s = sch.settings
    # an update arrives train_iters + 1 iterations after the batch it trains on; the
    # last two have not reached the generator when the fifth batch is taken
    assert sch.updates == [r.take_iter + 1 + s.train_iters for r in recs[-2:]]
    assert sch.gen_version == 3 and sch.trainer_version == 4
    assert [r.step for r in recs] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("on_update", ["continue", "finish"])
def test_resume_from_state_repeats_the_uninterrupted_schedule(on_update):
    s = _settings(on_update=on_update)
    whole = StreamSchedule(s, LENGTHS)
    a = whole.run_steps(25)
    first = StreamSchedule(s, LENGTHS)
    b = first.run_steps(11)
    saved = json.loads(json.dumps(first.state()))       # mid-flight: slots busy
    assert saved["slots"]
    resumed = StreamSchedule.from_state(s, LENGTHS, saved)
    b += resumed.run_steps(14)
    assert [(r.step, r.take_iter, r.group_ids, r.metrics) for r in a] == \
           [(r.step, r.take_iter, r.group_ids, r.metrics) for r in b]
    assert resumed.state() == whole.state()



def test_the_state_holds_only_the_segments_of_groups_not_yet_in_the_buffer():
    # a finished group's segments go with it into the buffer: the checkpoint stays
    # bounded however many steps have run
    s = _settings(on_update="continue")
    sch = StreamSchedule(s, LENGTHS)
    sizes = []
    for _ in range(4):
        sch.run_steps(10)
        st = sch.state()
        pending = {i for gid, got in sch.done_samples.items() for i in got}
        assert {int(k) for k in st["segments"]} == pending
        sizes.append(len(st["segments"]))
    # an unfinished group has a sample in a slot or the next to admit
    assert max(sizes) <= (s.slots + 1) * s.group_size < 10 * s.batch_groups * s.group_size


def test_constant_lengths_run_the_schedule_of_their_list_without_one():
    # the runtime's schedule: a cap per sample and no count known ahead, nothing listed
    s = _settings(k=1)
    lazy = ConstantLengths(7, sys.maxsize)
    assert len(lazy) == sys.maxsize and lazy[10 ** 15] == 7 and lazy[3:6] == [7, 7, 7]
    with pytest.raises(IndexError):
        ConstantLengths(7, 4)[4]
    want = StreamSchedule(s, [7] * 2000).run_steps(20)
    got = StreamSchedule(s, lazy).run_steps(20)
    assert [(r.take_iter, r.group_ids, r.metrics) for r in got] == \
           [(r.take_iter, r.group_ids, r.metrics) for r in want]

def test_steady_state_beats_synchronous_on_a_long_tail_and_bound_loosens_drops():
    ss = {k: steady_state(_settings(k=k, slots=8, train_iters=30), LENGTHS, 40)
          for k in (1, 2, 4)}
    for k, st in ss.items():
        assert st.speedup_vs_synchronous > 1.0
        assert st.staleness_mean <= k
    assert ss[4].dropped_per_step <= ss[1].dropped_per_step


def test_synchronous_iters_refills_slots():
    s = _settings(group_size=1, batch_groups=3, slots=2, train_iters=5, update_iters=1)
    # rows 4, 1, 3 in two slots: slot ends 4 and 1+3=4 -> 4, plus 5 + 1
    assert synchronous_iters(s, [4, 1, 3], 1) == 10
