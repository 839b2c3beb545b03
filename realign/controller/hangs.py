"""Hangs turned into errors: from the workers' heartbeats
(:mod:`realign.worker.watchdog`), the op that has run past its time limit once all its
ranks reached it, and who is holding it up. Pure: fed beats and clock readings.

An op's clock starts when the controller first sees every rank of the op in it or past
it (ranks still before it are in an earlier op, which its own clock judges; a rank
that idles at a transfer while its peer generates for an hour is not timed). Within
the op, a rank that is working (not waiting in a collective) while its peers wait is
the one that did not arrive; when every rank still in it waits on a peer, the
collectives do not match (a rank called another one, or none).

Example: ranks 0 and 1 generate (``actor.generate``, limit 5 s); rank 1 stalls in it,
rank 0 finishes and waits in ``actor.train``: 5 s after both were seen at the call,
``step 0: actor.generate (ranks 0, 1) did not finish within 5 s of all its ranks
reaching it: rank 1 did not arrive at its collectives (working in it for 7 s, not
waiting on a peer); rank 0 finished it``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Beat:
    """One heartbeat: where a worker is (see ``Position.beat``)."""

    rank: int
    step: int | None
    op: int | None
    in_op: bool
    label: str
    ranks: tuple[int, ...]
    bound_s: float
    in_op_s: float
    waiting_s: float | None

    @classmethod
    def of(cls, msg: tuple) -> "Beat":
        _tag, rank, step, op, in_op, label, ranks, bound_s, in_op_s, waiting_s = msg
        return cls(rank, step, op, in_op, label, tuple(ranks), bound_s, in_op_s, waiting_s)


def where(beat: Beat | None, step: int, op: int) -> str:
    """``before``, ``in`` or ``past`` op ``op`` of ``step`` (ops are walked in one
    order by every rank; a rank skips the ops it takes no part in).

    >>> b = Beat(0, 2, 5, True, "x", (0,), 1.0, 0.0, None)
    >>> where(b, 2, 5), where(b, 2, 4), where(b, 2, 6), where(b, 1, 9), where(None, 0, 0)
    ('in', 'past', 'before', 'past', 'before')
    """
    if beat is None or beat.step is None or beat.op is None:
        return "before"
    mine, theirs = (beat.step, beat.op), (step, op)
    if mine < theirs:
        return "before"
    if mine == theirs:
        return "in" if beat.in_op else "past"
    return "past"


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


class HangWatch:
    """The beats seen so far and when each op's ranks were first all seen at it."""

    def __init__(self) -> None:
        self.beats: dict[int, Beat] = {}
        self.started: dict[tuple[int, int], float] = {}

    def observe(self, beat: Beat) -> None:
        self.beats[beat.rank] = beat

    def overdue(self, now: float) -> str | None:
        """What holds the run, when an op has run past its limit (None otherwise);
        ``now``: the controller's monotonic clock."""
        current: dict[tuple[int, int], Beat] = {}
        for b in self.beats.values():
            if b.in_op and b.step is not None and b.op is not None:
                current.setdefault((b.step, b.op), b)
        self.started = {k: t for k, t in self.started.items() if k in current}
        for (step, op), b in sorted(current.items()):
            states = {r: where(self.beats.get(r), step, op) for r in b.ranks}
            if "before" in states.values():
                continue
            t0 = self.started.setdefault((step, op), now)
            if now - t0 > b.bound_s:
                return self._message(step, b, states)
        return None

    def _message(self, step: int, b: Beat, states: dict[int, str]) -> str:
        inside = [r for r, s in states.items() if s == "in"]
        working = [r for r in inside if self.beats[r].waiting_s is None]
        waiting = [r for r in inside if r not in working]
        done = [r for r, s in states.items() if s == "past"]
        head = (f"step {step}: {b.label} ({_ranks(list(b.ranks))}) did not finish within "
                f"{b.bound_s:g} s of all its ranks reaching it (run.call_timeout_s)")
        parts = []
        if working:
            secs = max(self.beats[r].in_op_s for r in working)
            parts.append(f"{_ranks(working)} did not arrive at its collectives (working in "
                         f"it for {secs:.0f} s, not waiting on a peer)")
        else:
            parts.append(f"every rank still in it waits on a peer ({_ranks(waiting)}): a "
                         "collective that some rank called differently or not at all")
        if working and waiting:
            parts.append(f"{_ranks(waiting)} wait on a peer in it")
        if done:
            parts.append(f"{_ranks(done)} finished it")
        return head + ": " + "; ".join(parts)
