"""A worker's second connection to its controller, served by a thread: the worker exits
within seconds when the controller is gone, and the controller learns where each
worker is (heartbeats), so that a call that hangs is named with the ranks that did not
arrive (:mod:`realign.controller.hangs`).

The main thread serves commands on the first connection and is busy inside a step for
as long as the step lasts, so it can neither notice a dead controller nor say where it
is. A daemon thread owns the second connection instead: every :data:`BEAT_S` it sends
the worker's :class:`Position` (which op of which step it is in, for how long, and
whether it waits on a peer in a collective); an end of file on the connection (the
controller's process ended, even by SIGKILL: its sockets close with it) ends the worker
at once with :data:`EXIT_CONTROLLER_GONE` (SIGKILLed with its process group when it
leads one: a vLLM engine's processes go too).

The test-only hook :data:`STALL_ENV` (``REALIGN_TEST_STALL=RANK:CALL:SECONDS[:STEP]``)
makes rank RANK sleep SECONDS inside call CALL (e.g. ``actor.generate``) the first time
it runs it at step STEP or later (default 0), to stand for a hang; the tests of hang
detection, of stop signals and of a killed controller set it, nothing else does.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from realign.run.ops import Op

#: seconds between heartbeats
BEAT_S = 1.0
#: a worker whose controller is gone exits with this code
EXIT_CONTROLLER_GONE = 75
#: the test-only stall hook's environment variable
STALL_ENV = "REALIGN_TEST_STALL"


@dataclass
class Position:
    """Where a worker is, written by its main thread, read by the watchdog thread.

    ``op``: index of the op in the step's op list (all ranks walk the same list);
    ``in_op``: inside it (False: it is done, the next one has not begun);
    ``waiting_since``: ``time.monotonic()`` when the current collective wait began.
    """

    timeout_of: Callable[[Op], float] = field(default=lambda op: 0.0)
    step: int | None = None
    op: int | None = None
    label: str = ""
    ranks: tuple[int, ...] = ()
    bound_s: float = 0.0
    in_op: bool = False
    since: float = 0.0
    waiting_since: float | None = None

    def enter(self, step: int, index: int, label: str, op: Op) -> None:
        self.label, self.ranks, self.bound_s = label, tuple(op.ranks), self.timeout_of(op)
        self.since, self.waiting_since = time.monotonic(), None
        self.step, self.op, self.in_op = step, index, True

    def leave(self) -> None:
        self.in_op = False

    def beat(self, rank: int) -> tuple:
        """The heartbeat message: ``("beat", rank, step, op, in_op, label, ranks, bound_s,
        seconds in the op, seconds waiting on a peer or None)``."""
        now = time.monotonic()
        waiting = self.waiting_since
        return ("beat", rank, self.step, self.op, self.in_op, self.label, self.ranks,
                self.bound_s, now - self.since, None if waiting is None else now - waiting)


@contextlib.contextmanager
def tracked_waits(position: Position) -> Iterator[None]:
    """While open, every ``Work.wait`` marks ``position`` as waiting on a peer (gloo
    waits block here; NCCL's return at once and the wait shows as work)."""
    import torch.distributed as dist

    work_cls = dist.Work
    inner = work_cls.wait

    def wait(self: dist.Work, *args: Any, **kwargs: Any) -> bool:      # Work.wait's own
        position.waiting_since = time.monotonic()
        try:
            return inner(self, *args, **kwargs)
        finally:
            position.waiting_since = None

    # torch's stubs declare Work.wait a method: patching it is the point here
    work_cls.wait = wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        work_cls.wait = inner  # type: ignore[method-assign]


def _gone(rank: int) -> None:
    print(f"worker {rank}: the controller is gone (its connection closed); exiting",
          file=sys.stderr, flush=True)
    if os.getpgid(0) == os.getpid():          # leads its group: take its children along
        with contextlib.suppress(OSError):
            os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(EXIT_CONTROLLER_GONE)


def watch(conn, rank: int, position: Position) -> threading.Thread:
    """Start the daemon thread that beats on ``conn`` and ends the process when the
    controller is gone."""
    def loop() -> None:
        try:
            while True:
                if conn.poll(BEAT_S):
                    conn.recv()                   # the controller sends nothing: EOF
                conn.send(position.beat(rank))
        except (EOFError, OSError):
            _gone(rank)

    t = threading.Thread(target=loop, name="realign-watchdog", daemon=True)
    t.start()
    return t


def stall_hook(environ) -> tuple[int, str, float, int] | None:
    """The test-only stall of :data:`STALL_ENV` (``RANK:CALL:SECONDS[:STEP]``) as
    (rank, call, seconds, from step), None if unset.

    >>> stall_hook({"REALIGN_TEST_STALL": "1:actor.generate:30"})
    (1, 'actor.generate', 30.0, 0)
    >>> stall_hook({"REALIGN_TEST_STALL": "0:actor.train:5:3"})
    (0, 'actor.train', 5.0, 3)
    """
    value = environ.get(STALL_ENV)
    if not value:
        return None
    rank, call, seconds, *step = value.split(":")
    return int(rank), call, float(seconds), int(step[0]) if step else 0
