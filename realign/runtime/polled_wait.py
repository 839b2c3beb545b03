"""Collective waits that poll instead of sleeping, for gloo workers on CPU.

Why: a thread blocked in ``Work.wait`` lets its CPU go idle; on a virtual machine an
idle vCPU is halted by the hypervisor and is woken, when the peer's bytes arrive,
often a scheduler tick late: on a 2-vCPU virtual machine a blocking all-reduce of 16
floats between two processes takes several times longer on average than a polled one
(benchmarks/step/README.md has the numbers). A small-model RL step waits on several
such collectives. MPI libraries busy-poll for the same reason.

torch offers no per-backend wait policy, so for the life of a CPU worker process
:func:`polled_waits` wraps ``Work.wait``: it polls ``is_completed()`` (yielding the
CPU each time, so gloo's own thread on the same core still runs) for at most
``budget_s``, then falls back to the blocking wait, which also raises the op's error
and applies its timeout. Only op types whose gloo work reports completion while it
runs are polled (checked in tests): gloo's reduce-scatter, send and recv works report
it only once waited on, so polling them would only add the budget.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

#: gloo works of these types report completion as soon as the collective is done
#: (the coalesced all-reduce of megatron's gradient sync answers ALLREDUCE)
POLLABLE = frozenset({"BROADCAST", "ALLREDUCE", "ALLGATHER", "ALLGATHER_COALESCED",
                      "BARRIER"})

#: poll this long before blocking: a collective whose peers are ready completes in
#: ~0.3 ms polled. Short, because a polling vCPU competes with its peers' when the
#: host is contended: a long budget (20 ms) made a tiny GRPO step on a contended host
#: about twice as slow as blocking (benchmarks/step/README.md).
DEFAULT_BUDGET_S = 0.002


def _op_codes(names: frozenset[str]) -> frozenset[int]:
    """``Work._get_op_type()`` answers the ``OpType`` enum's integer value."""
    members = getattr(getattr(torch._C._distributed_c10d, "OpType", None), "__members__", {})
    return frozenset(int(members[n]) for n in names if n in members)


_POLLABLE_CODES = _op_codes(POLLABLE)


def pollable(work) -> bool:
    try:
        return int(work._get_op_type()) in _POLLABLE_CODES
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False     # a private API: if it changes, every wait just blocks


def poll_then_wait(work, blocking_wait, budget_s: float, *args, **kwargs):
    """Poll a pollable ``work`` until done or ``budget_s`` is spent, then
    ``blocking_wait(work, ...)`` (at once when done: it returns, or raises the op's
    error)."""
    if pollable(work):
        deadline = time.perf_counter() + budget_s
        while not work.is_completed() and time.perf_counter() < deadline:
            os.sched_yield()
    return blocking_wait(work, *args, **kwargs)


@contextlib.contextmanager
def polled_waits(budget_s: float = DEFAULT_BUDGET_S) -> Iterator[None]:
    """While open, ``Work.wait`` of pollable works polls for up to ``budget_s``."""
    work_cls = dist.Work
    blocking_wait = work_cls.wait

    def wait(self, *args, **kwargs):
        return poll_then_wait(self, blocking_wait, budget_s, *args, **kwargs)

    work_cls.wait = wait  # type: ignore[method-assign]  # the patch, undone below
    try:
        yield
    finally:
        work_cls.wait = blocking_wait  # type: ignore[method-assign]
