"""Hangs turned into errors and stop signals, as logic: which op is overdue and who
holds it up (from heartbeats), the stop request's first and second signal, and the
call timeouts a prepared run derives from its plan."""
from __future__ import annotations

import signal

import pytest

from realign.controller.hangs import Beat, HangWatch
from realign.controller.stopping import StopNow, StopRequest
from realign.run.spec import CALL_TIMEOUT_SAFETY, COLLECTIVE_MARGIN_S, MIN_CALL_TIMEOUT_S
from tests.run.specs import planned_spec

pytestmark = pytest.mark.pure


def beat(rank, step, op, in_op=True, waiting=None, label="actor.generate", ranks=(0, 1),
         bound=5.0, in_op_s=1.0):
    return Beat(rank, step, op, in_op, label, ranks, bound, in_op_s, waiting)


def test_a_working_rank_whose_peer_waits_is_named_once_the_limit_passes():
    w = HangWatch()
    w.observe(beat(0, 0, 3, waiting=2.0))
    w.observe(beat(1, 0, 3, waiting=None, in_op_s=7.0))
    assert w.overdue(100.0) is None                  # the clock starts now
    assert w.overdue(104.9) is None
    msg = w.overdue(105.1)
    assert msg.startswith("step 0: actor.generate (ranks 0, 1) did not finish within 5 s")
    assert "rank 1 did not arrive at its collectives (working in it for 7 s" in msg
    assert "rank 0 wait on a peer in it" in msg


def test_a_rank_that_finished_is_said_so():
    w = HangWatch()
    w.observe(beat(0, 2, 4, in_op=False))            # done with op 4, nothing new yet
    w.observe(beat(1, 2, 4))
    w.overdue(0.0)
    msg = w.overdue(6.0)
    assert "rank 1 did not arrive" in msg and "rank 0 finished it" in msg
    w2 = HangWatch()
    w2.observe(beat(0, 2, 7, label="actor.train"))   # past it, in a later op
    w2.observe(beat(1, 2, 4))
    w2.overdue(0.0)
    assert "rank 0 finished it" in w2.overdue(6.0)


def test_an_op_whose_ranks_have_not_all_arrived_is_not_timed():
    """Rank 0 idles at a transfer while rank 1 is still in a long call of its own mesh:
    only that call is timed, by its own limit."""
    w = HangWatch()
    w.observe(beat(0, 0, 5, waiting=50.0, label="send rollout", bound=5.0))
    w.observe(beat(1, 0, 2, label="reward.inference", ranks=(1,), bound=60.0))
    w.overdue(0.0)
    assert w.overdue(50.0) is None
    assert "reward.inference (rank 1)" in w.overdue(61.0)


def test_every_rank_waiting_means_mismatched_collectives():
    w = HangWatch()
    w.observe(beat(0, 1, 3, waiting=9.0))
    w.observe(beat(1, 1, 3, waiting=9.0))
    w.overdue(0.0)
    assert "every rank still in it waits on a peer (ranks 0, 1)" in w.overdue(6.0)


def test_the_clock_restarts_for_each_op():
    w = HangWatch()
    w.observe(beat(0, 0, 1))
    w.observe(beat(1, 0, 1))
    w.overdue(0.0)
    w.observe(beat(0, 0, 2))
    w.observe(beat(1, 0, 2))
    assert w.overdue(4.0) is None                   # op 2 first seen at 4 s
    assert w.overdue(8.0) is None
    assert w.overdue(9.5) is not None


def test_first_signal_asks_second_stops_at_once_later_ones_are_ignored():
    s = StopRequest()
    assert not s.requested
    s.handle(signal.SIGUSR1)
    assert s.requested and s.name == "SIGUSR1"
    with pytest.raises(StopNow, match="SIGTERM again"):
        s.handle(signal.SIGTERM)
    s.handle(signal.SIGTERM)                        # stopping already: ignored
    assert s.name == "SIGUSR1"


def test_installed_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest().installed() as s:
        assert signal.getsignal(signal.SIGTERM) == s.handle
    assert signal.getsignal(signal.SIGTERM) == before


def test_call_timeouts_derive_from_the_plan_or_the_run_section(tmp_path):
    spec = planned_spec(tmp_path)
    program = spec.program()
    calls = [op for op in program.ops if hasattr(op, "estimate_s")]
    assert calls
    for op in calls:
        assert spec.call_timeout_s(op) == max(MIN_CALL_TIMEOUT_S,
                                              CALL_TIMEOUT_SAFETY * op.estimate_s)
    longest = max(spec.call_timeout_s(op) for op in program.ops)
    assert spec.collective_timeout_s() >= longest + COLLECTIVE_MARGIN_S
    run = spec.config.run.model_copy(update={"call_timeout_s": 30.0})
    fixed = spec.model_copy(update={"config": spec.config.model_copy(update={"run": run})})
    assert all(fixed.call_timeout_s(op) == 30.0 for op in program.ops)
    assert fixed.collective_timeout_s() == max(program.collective_timeout_s(),
                                               30.0 + COLLECTIVE_MARGIN_S)
