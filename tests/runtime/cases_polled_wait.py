"""Collectives under ``polled_waits`` inside the gloo world."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from realign.runtime.polled_wait import pollable, polled_waits


def _coalesced(issue):
    from torch.distributed.distributed_c10d import _coalescing_manager

    with _coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
        issue()
    return cm.works[0]


def collectives_polled(ctx):
    """Every collective the runtime uses gives its usual result under polled waits;
    returns which op types were polled and whether their works completed on their own
    (without ``wait``), and whether the blocking wait is back afterwards."""
    r = ctx.rank
    original = dist.Work.wait
    with polled_waits(budget_s=5.0):
        inside = dist.Work.wait is not original
        t = torch.tensor([float(r + 1)] * 3)
        dist.all_reduce(t)
        parts = [torch.empty(2) for _ in range(2)]
        dist.all_gather(parts, torch.full((2,), float(r)))
        flat = torch.empty(4)
        dist.all_gather_into_tensor(flat, torch.full((2,), float(r)))
        b = torch.full((2,), float(r))
        dist.broadcast(b, src=1)
        dist.barrier()
        rs = torch.empty(1)
        dist.reduce_scatter_tensor(rs, torch.tensor([1.0, 2.0]) * (r + 1))
        p2p = torch.full((3,), 7.0) if r == 0 else torch.empty(3)
        if r == 0:
            dist.send(p2p, dst=1)
        else:
            dist.recv(p2p, src=0)
        objs = [None, None]
        dist.all_gather_object(objs, {"rank": r})
        results = {"all_reduce": t.tolist(), "all_gather": [p.tolist() for p in parts],
                   "all_gather_into_tensor": flat.tolist(), "broadcast": b.tolist(),
                   "reduce_scatter": rs.tolist(), "p2p": p2p.tolist(), "objects": objs}
        # which works poll, and do they report completion without being waited on
        kinds = {}
        for name, start in [
                ("all_reduce", lambda: dist.all_reduce(torch.ones(2), async_op=True)),
                ("all_gather", lambda: dist.all_gather([torch.empty(1), torch.empty(1)],
                                                       torch.ones(1), async_op=True)),
                ("broadcast", lambda: dist.broadcast(torch.ones(2), src=0, async_op=True)),
                ("barrier", lambda: dist.barrier(async_op=True)),
                ("reduce_scatter", lambda: dist.reduce_scatter_tensor(
                    torch.empty(1), torch.ones(2), async_op=True)),
                # what megatron's gradient sync and parameter all-gather issue
                ("coalesced_all_reduce", lambda: _coalesced(
                    lambda: dist.all_reduce(torch.ones(2)))),
                ("coalesced_all_gather", lambda: _coalesced(
                    lambda: dist.all_gather_into_tensor(torch.empty(2), torch.ones(1))))]:
            work = start()
            deadline = time.monotonic() + 5.0
            while pollable(work) and not work.is_completed() and time.monotonic() < deadline:
                time.sleep(0.001)
            kinds[name] = (pollable(work), work.is_completed())
            work.wait()
    return results, kinds, inside, dist.Work.wait is original
