"""A world of N ranks (gloo; gloo + NCCL on GPUs) on this machine that runs many calls: for tests and
benchmarks (importing torch and megatron-core costs seconds per process, so spawn the
world once and run every case in it).

``with LocalWorld(4) as w: results = w.run(fn, *args)`` calls ``fn(ctx, *args)`` on
every rank at once (inside an initialised default process group, rank = GPU index)
and returns the per-rank results, or raises :class:`RankFailure` with every failed
rank's traceback. ``fn`` is a picklable module-level function or its name,
``"module:function"``, imported in the workers (whose ``sys.path`` is the caller's).
``ctx`` is the rank's :class:`RankContext`: its rank, the world size and a ``store``
dict that lives as long as the world (for a model an earlier case built). A call that
does not finish within its timeout has every rank print its Python stack (to stderr),
stops the world and raises :class:`TimeoutError`: no hung CI.
"""
from __future__ import annotations

import datetime
import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class RankError:
    """An exception raised on one rank, as data (exceptions may not pickle)."""

    rank: int
    type_name: str
    message: str
    traceback: str


class RankFailure(RuntimeError):
    def __init__(self, errors: list[RankError]):
        self.errors = errors
        super().__init__("\n".join(f"rank {e.rank}: {e.type_name}: {e.message}\n{e.traceback}"
                                   for e in errors))


@dataclass
class RankContext:
    """What a call receives first: its rank, the world size, a per-process store."""

    rank: int
    world: int
    store: dict = field(default_factory=dict)


def _resolve(fn: Callable | str) -> Callable:
    if isinstance(fn, str):
        module, name = fn.split(":")
        return getattr(importlib.import_module(module), name)
    return fn


def _worker(rank: int, world: int, port: int, threads: int, timeout_s: float, device: str,
            inbox: mp.Queue, outbox: mp.Queue) -> None:
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    # the runs' own world (realign.worker.session): on CUDA, gloo for CPU tensors and
    # NCCL for CUDA ones, each rank on its GPU; a gloo-only world would hand megatron's
    # CUDA gradient buffers to gloo
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout,
                          wait_for_workers=False)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", store=store,
                            rank=rank, world_size=world, timeout=timeout,
                            device_id=torch.device("cuda", rank) if cuda else None)
    ctx = RankContext(rank, world)
    outbox.put((rank, "ready", pickle.dumps(None)))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            # plain pickle: torch's multiprocessing reductions would pass tensors
            # through shared-memory handles that outlive the call
            outbox.put((rank, "ok", pickle.dumps(_resolve(fn)(ctx, *args))))
        except BaseException as e:  # report, keep serving
            outbox.put((rank, "err", pickle.dumps(RankError(rank, type(e).__name__, str(e),
                                                            traceback.format_exc()))))
    dist.destroy_process_group()


class LocalWorld:
    """``n`` spawned ranks on 127.0.0.1, each with ``threads`` intra-op threads; on
    ``device`` "cpu" a gloo world, on "cuda" rank r drives GPU r (gloo + NCCL)."""

    def __init__(self, n: int, threads: int = 1, timeout_s: float = 120.0, device: str = "cpu"):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"LocalWorld device must be 'cpu' or 'cuda', not {device!r}")
        self.n, self.threads, self.timeout_s = n, threads, timeout_s
        ctx = mp.get_context("spawn")
        # the world's store lives here, on a port the system assigns as it binds it (a
        # port chosen first and bound later by a rank can be taken in between)
        import torch.distributed as dist
        self._store = dist.TCPStore("127.0.0.1", 0, n, is_master=True,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        port = self._store.port
        self._out = ctx.Queue()
        self._ins = [ctx.Queue() for _ in range(n)]
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, n, port, threads, timeout_s, device, self._ins[r],
                                         self._out))
                       for r in range(n)]
        for p in self._procs:
            p.start()
        self._collect("ready", timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        got: dict[int, tuple[str, Any]] = {}
        while len(got) < self.n:
            try:
                rank, status, value = self._out.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(self.n)) - set(got))
                self._dump_stacks()
                self.close()
                raise TimeoutError(f"ranks {missing} did not finish {what} within "
                                   f"{timeout_s:.0f} s; world stopped") from None
            got[rank] = (status, pickle.loads(value))
        errors = [v for s, v in got.values() if s == "err"]
        if errors:
            raise RankFailure(sorted(errors, key=lambda e: e.rank))
        return [got[r][1] for r in range(self.n)]

    def _dump_stacks(self) -> None:
        """Have every live rank print its Python stack to stderr (faulthandler)."""
        import time
        for p in self._procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)

    def run(self, fn: Callable | str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """``fn(ctx, *args)`` on every rank; per-rank results in rank order."""
        for q in self._ins:
            q.put((fn, args))
        name = fn if isinstance(fn, str) else getattr(fn, "__name__", "call")
        return self._collect(name, timeout_s or self.timeout_s)

    def close(self) -> None:
        for q in self._ins:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()  # only our own children, by handle
                p.join()

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
