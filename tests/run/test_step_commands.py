"""Which step commands the controller sends ahead: every step once and in order, at
most one beyond the running step, and none past a checkpoint before it is written."""
from __future__ import annotations

import pytest

from realign.controller.controller import saves_after, steps_to_send

pytestmark = pytest.mark.pure


def simulate(start: int, steps: int, interval: int) -> list[tuple[str, int]]:
    """The controller's loop as a list of events: ("send", j), ("done", j), ("save", j)."""
    events, sent = [], start

    def send_ahead(current):
        nonlocal sent
        for j in steps_to_send(current, sent, steps, interval):
            events.append(("send", j))
            sent = j + 1

    send_ahead(start)
    for step in range(start, steps):
        events.append(("done", step))
        if saves_after(step, steps, interval):
            events.append(("save", step + 1))
            if step + 1 < steps:
                send_ahead(step + 1)
        else:
            send_ahead(step + 1)
    return events


@pytest.mark.parametrize("start,steps,interval", [(0, 7, 3), (0, 6, 2), (3, 10, 1),
                                                  (2, 5, 10), (0, 1, 1)])
def test_every_step_is_sent_once_in_order_and_never_past_a_checkpoint(start, steps, interval):
    events = simulate(start, steps, interval)
    assert [j for kind, j in events if kind == "send"] == list(range(start, steps))
    done = start - 1
    for i, (kind, j) in enumerate(events):
        if kind == "done":
            done = j
        elif kind == "send":
            assert j <= done + 2, "at most one step beyond the running one"
            for b in range(start + 1, j + 1):       # checkpoints before step j: written
                if saves_after(b - 1, steps, interval):
                    assert ("save", b) in events[:i], (j, b)


def test_sends_one_ahead_between_checkpoints():
    assert list(steps_to_send(0, 0, 10, 5)) == [0, 1]
    assert list(steps_to_send(1, 2, 10, 5)) == [2]
    assert list(steps_to_send(4, 5, 10, 5)) == []          # step 4 ends in a checkpoint
    assert list(steps_to_send(3, 4, 10, 5)) == [4]
    assert list(steps_to_send(9, 9, 10, 5)) == [9]         # the last step, nothing after
