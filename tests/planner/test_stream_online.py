"""The streaming schedule's online form (planner.graph.streaming: begin_iteration,
end_iteration, take_iteration), fed with the end-of-sequence events a runtime sees,
makes the same steps, batches, versions and metrics as the list-of-lengths
simulation, for both update policies and with a resume from its state in between."""
from __future__ import annotations

import json

import pytest

from planner.graph.streaming import StreamSchedule, StreamSettings, draw_lengths

pytestmark = pytest.mark.pure


def online_steps(settings, lengths, n_steps, cap, cut=None):
    """Drive the online form with ``cap`` as every sample's limit; a sample ends when it
    has made its ``lengths`` entry. ``cut``: resume from JSON state after that step."""
    sch = StreamSchedule(settings, [cap] * len(lengths))
    made: dict[int, int] = {}
    recs = []
    while len(recs) < n_steps:
        it = sch.begin_iteration()
        if it.decodes:
            for sl in sch.slots:
                made[sl.sample] = made.get(sl.sample, 0) + 1
            sch.end_iteration({sl.sample for sl in sch.slots
                               if made[sl.sample] == max(1, min(cap, lengths[sl.sample]))})
        rec = sch.take_iteration()
        if rec is not None:
            recs.append(rec)
            if cut is not None and len(recs) == cut:
                sch = StreamSchedule.from_state(settings, [cap] * len(lengths),
                                                json.loads(json.dumps(sch.state())))
    return recs, sch


@pytest.mark.parametrize("on_update", ["continue", "finish"])
@pytest.mark.parametrize("cut", [None, 3])
def test_the_online_form_repeats_the_simulation(on_update, cut):
    s = StreamSettings(group_size=4, batch_groups=3, slots=8, train_iters=7, update_iters=2,
                       max_staleness=1, on_update=on_update)
    cap = 40
    lengths = draw_lengths(9.0, cap, 4000, seed=1)
    want = StreamSchedule(s, lengths).run_steps(8)
    got, sch = online_steps(s, lengths, 8, cap, cut)
    assert [(r.step, r.take_iter, r.group_ids, r.metrics) for r in got] == \
        [(r.step, r.take_iter, r.group_ids, r.metrics) for r in want]
    assert any(r.metrics["stream.staleness_mean"] > 0 for r in got)
