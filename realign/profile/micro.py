"""Micro-benchmarks run on every worker of the profile's world at once (one process
per device, the runs' thread count): GEMM rates over a grid, streaming memory
bandwidth, and collectives by op, group size and message size. Each function is
called by :class:`realign.runtime.local_world.LocalWorld` as ``fn(ctx, ...)``.

Timings are medians of several samples, each a batch of calls long enough to be
timed well (a GEMM of a few microseconds is run hundreds of times per sample).
"""
from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from realign.runtime.device import DTYPES

#: each timing sample lasts at least this long (seconds)
SAMPLE_S = 0.01
SAMPLES = 5


def device_of(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], dev: torch.device, sample_s: float = SAMPLE_S,
          samples: int = SAMPLES) -> float:
    """Median seconds of one ``fn()`` call over ``samples`` samples of ``k`` calls."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    one = max(time.perf_counter() - t0, 1e-7)
    k = max(1, min(1000, int(sample_s / one)))
    out = []
    for _ in range(samples):
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        sync(dev)
        out.append((time.perf_counter() - t0) / k)
    return statistics.median(out)


def gemm_grid(ctx, kind: str, dtype: str, rows: list[int], widths: list[int]
              ) -> tuple[list[list[float]], list[list[float]]]:
    """(forward, forward+backward) FLOP/s of ``[rows, w] x [w, w]`` on this rank's
    device, [rows][widths]."""
    dev = device_of(kind, ctx.rank)
    dt = DTYPES[dtype]
    fwd, train = [], []
    g = torch.Generator(device=dev).manual_seed(ctx.rank)
    for m in rows:
        fr, tr = [], []
        for w in widths:
            x = torch.randn(m, w, device=dev, dtype=dt, generator=g)
            W = torch.randn(w, w, device=dev, dtype=dt, generator=g) * w ** -0.5
            with torch.inference_mode():
                s = timed(partial(F.linear, x, W), dev)
            fr.append(2.0 * m * w * w / s)
            xg = x.clone().requires_grad_(True)
            Wg = W.clone().requires_grad_(True)
            grad = torch.ones(m, w, device=dev, dtype=dt)

            def step(xg=xg, Wg=Wg, grad=grad):
                y = F.linear(xg, Wg)
                return torch.autograd.grad(y, (xg, Wg), grad)
            s = timed(step, dev)
            tr.append(6.0 * m * w * w / s)
        fwd.append(fr)
        train.append(tr)
    return fwd, train


def mem_bandwidth(ctx, kind: str, nbytes: int) -> float:
    """Bytes/s of copying a large buffer (read + write counted)."""
    dev = device_of(kind, ctx.rank)
    src = torch.ones(nbytes // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), dev, sample_s=0.05, samples=5)
    return 2.0 * nbytes / s


def host_link_bandwidth(ctx, kind: str, nbytes: int) -> float | None:
    """Bytes/s between pinned host memory and the device, the mean of both directions
    (what optimizer and training-state offload move); None on the cpu device, whose
    "device" memory is the host's."""
    if kind != "cuda":
        return None
    dev = device_of(kind, ctx.rank)
    on_dev = torch.ones(nbytes // 4, device=dev, dtype=torch.float32)
    on_host = torch.empty(on_dev.shape, dtype=torch.float32, pin_memory=True)
    down = timed(lambda: on_host.copy_(on_dev), dev, sample_s=0.05, samples=5)
    up = timed(lambda: on_dev.copy_(on_host), dev, sample_s=0.05, samples=5)
    return 2.0 * nbytes / (down + up)


def _groups(world: int) -> dict[int, object]:
    """A process group of ranks 0..n-1 for each power of two n in 2..world (every rank
    creates every group); the world itself for n == world."""
    out: dict[int, object] = {}
    n = 2
    while n <= world:
        out[n] = dist.new_group(ranks=list(range(n))) if n < world else None
        n *= 2
    if world >= 2:
        out[world] = None
    return out


def collectives(ctx, kind: str, sizes: list[int]) -> dict[str, list[tuple[int, float]]]:
    """``"op n" -> [(bytes, seconds)]`` for all-reduce, all-gather, reduce-scatter,
    broadcast and all-to-all (expert parallelism's token exchange: each rank's tensor
    split evenly over the ranks) over ranks 0..n-1 (each power of two n up to the
    world), and ``"p2p 2"`` for one message between ranks 0 and 1 (half a ping-pong).
    CPU waits poll, as the workers' do (:mod:`realign.runtime.polled_wait`)."""
    import contextlib

    from realign.runtime.polled_wait import polled_waits
    dev = device_of(kind, ctx.rank)
    world, me = dist.get_world_size(), dist.get_rank()
    out: dict[str, list[tuple[int, float]]] = {}
    with polled_waits() if kind == "cpu" else contextlib.nullcontext():
        for n, group in sorted(_groups(world).items()):
            member = me < n
            for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
                pts = []
                for nbytes in sizes:
                    elems = max(n, nbytes // 4 // n * n)
                    t = torch.ones(elems, device=dev)
                    part = torch.empty(elems // n, device=dev)
                    swapped = torch.empty(elems, device=dev)
                    fn = {
                        "all_reduce": lambda t=t, g=group: dist.all_reduce(t, group=g),
                        "all_gather": lambda t=t, p=part, g=group:
                            dist.all_gather_into_tensor(t, p, group=g),
                        "reduce_scatter": lambda t=t, p=part, g=group:
                            dist.reduce_scatter_tensor(p, t, group=g),
                        "broadcast": lambda t=t, g=group: dist.broadcast(t, src=0, group=g),
                        "all_to_all": lambda t=t, o=swapped, g=group:
                            dist.all_to_all_single(o, t, group=g),
                    }[op]
                    if member:
                        pts.append((elems * 4, _collective_time(fn, dev, group)))
                    dist.barrier()
                out[f"{op} {n}"] = pts
        if world >= 2:
            pts = []
            for nbytes in sizes:
                t = torch.ones(max(1, nbytes // 4), device=dev)
                if me in (0, 1):
                    peer = 1 - me

                    def ping(t=t, peer=peer):
                        if me == 0:
                            dist.send(t, peer)
                            dist.recv(t, peer)
                        else:
                            dist.recv(t, peer)
                            dist.send(t, peer)
                    k = 20 if nbytes <= (1 << 20) else 4
                    pts.append((t.numel() * 4,
                                _collective_time(ping, dev, None, pairs=True, k=k) / 2))
                dist.barrier()
            out["p2p 2"] = pts
    return out


def _collective_time(fn, dev, group, pairs: bool = False, k: int | None = None) -> float:
    """Median seconds of ``fn`` on the group's ranks, which start each sample together."""
    samples = []
    t0 = time.perf_counter()
    fn()
    sync(dev)
    # calls per sample: ~20 ms of them, 1..20 (the same on every rank: a collective
    # needs all its ranks to call it equally often)
    if k is None:
        guess = torch.tensor([max(1e-6, time.perf_counter() - t0)], device=dev)
        dist.all_reduce(guess, op=dist.ReduceOp.MAX, group=group)
        k = int(max(1, min(20, 0.02 / float(guess))))
    for _ in range(SAMPLES + 2):
        if not pairs:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        sync(dev)
        samples.append((time.perf_counter() - t0) / k)
    return statistics.median(samples)
