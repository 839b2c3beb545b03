"""A world of N gloo ranks on this machine that runs picklable calls, for tests and
benchmarks: importing torch costs seconds per process, so spawn once, run many cases.

``with LocalWorld(4) as w: results = w.run(fn, *args)`` calls ``fn(*args)`` on every
rank (inside an initialised default process group, rank = GPU index) and returns the
per-rank results, or raises :class:`RankFailure` with every failed rank's traceback.
"""
from __future__ import annotations

import datetime
import queue
import socket
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, threads: int, timeout_s: float,
            inbox: mp.Queue, outbox: mp.Queue) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    outbox.put((rank, "ready", None))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, "ok", fn(*args)))
        except BaseException as e:  # report, keep serving
            outbox.put((rank, "err", RankError(rank, type(e).__name__, str(e),
                                               traceback.format_exc())))
    dist.destroy_process_group()


class LocalWorld:
    """``n`` spawned gloo ranks on 127.0.0.1, each with ``threads`` intra-op threads."""

    def __init__(self, n: int, threads: int = 1, timeout_s: float = 120.0):
        self.n, self.threads, self.timeout_s = n, threads, timeout_s
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._out = ctx.Queue()
        self._ins = [ctx.Queue() for _ in range(n)]
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, n, port, threads, timeout_s, self._ins[r], self._out))
                       for r in range(n)]
        for p in self._procs:
            p.start()
        self._collect("ready")

    def _collect(self, what: str) -> list[Any]:
        got: dict[int, tuple[str, Any]] = {}
        while len(got) < self.n:
            try:
                rank, status, value = self._out.get(timeout=self.timeout_s + 30)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(self.n)) - set(got))} did not "
                                   f"answer ({what}) within {self.timeout_s + 30:.0f} s") from None
            got[rank] = (status, value)
        errors = [v for s, v in got.values() if s == "err"]
        if errors:
            raise RankFailure(sorted(errors, key=lambda e: e.rank))
        return [got[r][1] for r in range(self.n)]

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(*args)`` on every rank; per-rank results in rank order."""
        for q in self._ins:
            q.put((fn, args))
        return self._collect(getattr(fn, "__name__", "call"))

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
