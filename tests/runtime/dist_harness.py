"""A gloo world of N worker processes that runs many test cases.

Start it once per test module (importing torch and megatron-core costs about 5 s per
process); each case is a module-level function ``fn(ctx, *args)`` in a module of
this folder, named as ``"module:function"``, run on every rank at once. The results
come back as a list indexed by rank; an exception on any rank fails the case with
that rank's traceback. A case that does not finish within its timeout kills the
world (no hung CI).

Run as a script, this file is the worker's main program.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Client, Listener
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CaseError(AssertionError):
    pass


class World:
    """``World(2)`` starts two ranks; ``world.run("cases:fn", arg)`` -> [r0, r1].

    ``paths``: more folders the workers import case modules from (this folder always).
    """

    def __init__(self, n: int, timeout_s: float = 120.0, paths: tuple[str, ...] = ()):
        self.n = n
        self.timeout_s = timeout_s
        authkey = os.urandom(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        port = _free_port()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   WORLD_SIZE=str(n), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   REALIGN_HARNESS_KEY=authkey.hex(),
                   REALIGN_HARNESS_PATHS=os.pathsep.join(str(p) for p in paths),
                   REALIGN_HARNESS_ADDR=f"127.0.0.1:{self._listener.address[1]}")
        self._procs = [subprocess.Popen([sys.executable, __file__, str(r)],
                                        env=dict(env, RANK=str(r)))
                       for r in range(n)]
        self._conns = [None] * n
        for _ in range(n):
            conn = self._listener.accept()
            rank = conn.recv()
            self._conns[rank] = conn

    def run(self, case: str, *args, timeout_s: float | None = None) -> list:
        for c in self._conns:
            c.send((case, args))
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        out, errors = [None] * self.n, []
        for rank, c in enumerate(self._conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                self._dump_stacks()
                self.close()
                raise CaseError(f"{case} timed out on rank {rank}; world stopped")
            ok, value = pickle.loads(c.recv_bytes())
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise CaseError(f"{case} failed:\n" + "\n".join(errors))
        return out

    def _dump_stacks(self) -> None:
        """Have every worker print its Python stack to stderr (faulthandler)."""
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        time.sleep(1.0)

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except Exception:
                pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._listener.close()


class Ctx:
    """What a case receives: its rank, the world size and a per-process store that
    lives as long as the world (for models built by an earlier case)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.store = rank, world, {}


def _worker(rank: int) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    for p in filter(None, os.environ["REALIGN_HARNESS_PATHS"].split(os.pathsep)):
        sys.path.insert(0, p)
    host, port = os.environ["REALIGN_HARNESS_ADDR"].split(":")
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["REALIGN_HARNESS_KEY"]))
    conn.send(rank)
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = Ctx(rank, world)
    while True:
        job = conn.recv()
        if job is None:
            break
        case, args = job
        try:
            mod, fn = case.split(":")
            result = getattr(importlib.import_module(mod), fn)(ctx, *args)
            reply = pickle.dumps((True, result))
        except BaseException:
            reply = pickle.dumps((False, traceback.format_exc()))
        # plain pickle: torch's multiprocessing reductions would pass tensors through
        # shared memory handles that outlive the case
        conn.send_bytes(reply)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]))
