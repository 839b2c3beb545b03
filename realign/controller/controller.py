"""The controller: starts the workers, hands them the plan, drives the steps, writes
metrics and checkpoints, and stops everything when a worker fails.

Only small messages pass through it (commands, metrics, tracebacks); tensors move
worker to worker. A failed worker is named with its traceback (or the tail of its
log when it died without one), the others are stopped, and ``run`` returns 1 within
seconds; nothing waits forever on a dead peer.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from functools import cached_property
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path

from realign.controller.metrics import MetricsLog, Progress, restore
from realign.launch.base import Launcher, worker_env
from realign.run import checkpoint
from realign.run.program import Program
from realign.run.spec import RunSpec

ACCEPT_TIMEOUT_S = 300.0
POLL_S = 0.2


class WorkerFailed(Exception):
    """A worker failed: ``detail`` is its traceback (or log tail); ``message`` the one
    line a user's error says, when it was one (then no traceback is shown)."""

    def __init__(self, rank: int, detail: str, message: str | None = None):
        self.rank, self.detail, self.message = rank, detail, message
        super().__init__(f"worker {rank} failed")


class Controller:
    def __init__(self, spec: RunSpec, launcher: Launcher, out=None):
        self.spec, self.launcher = spec, launcher
        self.out = out or sys.stdout
        self.conns: dict[int, Connection] = {}
        self.master_port = 0        #: the launcher's rendezvous port (0: rank 0 chooses)
        #: the metrics lines of the steps since the last checkpoint, which the next
        #: checkpoint keeps (a damaged metrics.jsonl is restored from them on resume)
        self.unsaved_lines: list[str] = []

    # ---- messaging ---------------------------------------------------------------
    def _log_tail(self, rank: int, n: int = 40) -> str:
        p = self.spec.run_dir / "logs" / f"worker{rank}.log"
        try:
            return "\n".join(p.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _check_exits(self) -> None:
        for ex in self.launcher.poll():
            conn = self.conns.get(ex.rank)
            try:
                if conn is not None and conn.poll():
                    self._handle(ex.rank, conn.recv())   # its last words: a traceback
            except (EOFError, OSError):
                pass                                     # died without a message
            raise WorkerFailed(ex.rank, f"exited with code {ex.returncode}\n"
                                        f"--- last lines of its log ---\n{self._log_tail(ex.rank)}")

    def _handle(self, rank: int, msg: tuple) -> tuple:
        if msg[0] == "error":
            # A peer's death makes the survivors' collectives fail too: if another
            # worker was killed, it is the cause; name it and keep this report.
            time.sleep(2 * POLL_S)
            for ex in self.launcher.poll():
                if ex.rank != rank and ex.returncode < 0:
                    raise WorkerFailed(ex.rank, f"was killed (signal {-ex.returncode})\n"
                                       f"--- last lines of its log ---\n{self._log_tail(ex.rank)}"
                                       f"\n--- then worker {rank} failed: ---\n{msg[1]}")
            raise WorkerFailed(rank, msg[1], msg[2] if len(msg) > 2 else None)
        return msg

    def gather(self, expect: str, ranks: list[int] | None = None) -> dict[int, tuple]:
        """One ``expect`` message from every worker (or those of ``ranks``); fail fast
        on errors or exits."""
        got: dict[int, tuple] = {}
        want = list(self.conns) if ranks is None else ranks
        while len(got) < len(want):
            pending = [c for r, c in self.conns.items() if r in want and r not in got]
            for conn in wait(pending, timeout=POLL_S):
                rank = next(r for r, c in self.conns.items() if c is conn)
                try:
                    msg = self._handle(rank, conn.recv())
                except (EOFError, ConnectionResetError):
                    time.sleep(POLL_S)
                    self._check_exits()
                    raise WorkerFailed(rank, "closed its connection\n"
                                       + self._log_tail(rank)) from None
                if msg[0] != expect:
                    raise WorkerFailed(rank, f"sent {msg[0]!r}, expected {expect!r}")
                got[rank] = msg
            self._check_exits()
        return got

    def broadcast(self, msg: tuple) -> None:
        for conn in self.conns.values():
            conn.send(msg)

    # ---- the run -----------------------------------------------------------------
    def start_workers(self) -> None:
        s = self.spec
        (s.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        authkey = os.urandom(16)
        net = self.launcher.network()
        self.master_port = net.master_port
        self.listener = Listener((net.bind_host, net.controller_port), authkey=authkey)
        addr = f"{net.advertise_host}:{self.listener.address[1]}"
        port = net.master_port        # 0: rank 0 binds one and the controller relays it
        logs = [str(s.run_dir / "logs" / f"worker{r}.log") for r in range(s.n_workers)]
        envs = [worker_env(r, s.n_workers, net.master_addr, port, addr, authkey.hex(), logs[r],
                           s.config.device) for r in range(s.n_workers)]
        self.launcher.start(envs, logs)
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S
        self.listener._listener._socket.settimeout(POLL_S)
        while len(self.conns) < s.n_workers:
            if time.monotonic() > deadline:
                raise WorkerFailed(-1, f"only {len(self.conns)} of {s.n_workers} workers "
                                       f"connected within {ACCEPT_TIMEOUT_S:.0f} s")
            try:
                conn = self.listener.accept()
            except (socket.timeout, TimeoutError):
                self._check_exits()
                continue
            rank = conn.recv()[1]
            self.conns[rank] = conn

    def relay_store_port(self) -> None:
        """Without a rendezvous port of the launcher's, rank 0 serves the world's store
        on one the system chose and reports it; the others learn it from here
        (:mod:`realign.worker.rendezvous`)."""
        if self.master_port == 0:
            port = self.gather("store", [0])[0][1]
            for rank, conn in self.conns.items():
                if rank != 0:
                    conn.send(("store", port))

    def resume_point(self) -> tuple[int, Path] | None:
        """The newest intact checkpoint of the run folder, checked against this run before
        any worker starts (a :class:`UserError` says why it cannot resume); damaged newer
        ones are set aside, and said so."""
        s = self.spec
        checkpoint.check_layout(s.run_dir)
        checkpoint.clean_partial(s.run_dir)
        resume, notes = checkpoint.resume_point(s.run_dir)
        for note in notes:
            print(f"realign run: {note}", file=self.out, flush=True)
        if resume:
            checkpoint.check_resumable(
                checkpoint.read_manifest(resume[1]), resume[1],
                s.config.train.uses_distributed_optimizer(s.config.device), self.trained)
        return resume

    @cached_property
    def program(self) -> Program:
        """The compiled program of the run's plan."""
        return self.spec.program()

    @property
    def trained(self) -> list[str]:
        """Keys of the trained copies (what a checkpoint holds)."""
        return sorted(r.key for r in self.program.replicas if r.trained)

    def run(self) -> int:
        s = self.spec
        resume = self.resume_point()
        start = resume[0] if resume else 0
        self.restore_metrics(start)
        finished = start >= s.steps
        if finished and checkpoint.final_intact(s.final_dir):
            print(f"already finished: {start} steps done (run.steps: {s.steps}); final "
                  f"{s.final_dir.name} at {s.final_dir}", file=self.out)
            return 0
        log = MetricsLog(s.run_dir, start)
        try:
            if resume:
                print(f"resuming from {resume[1]} (step {start})", file=self.out, flush=True)
            if finished:
                print(f"all {s.steps} steps are done, but final {s.final_dir.name} is missing "
                      f"or incomplete: writing it again from {resume[1].name}", file=self.out,
                      flush=True)
            self.start_workers()
            self.broadcast(("setup", s.model_dump_json(), str(resume[1]) if resume else None))
            self.relay_store_port()
            self.gather("ready")
            progress = Progress(s.steps, start, self.out)
            # Workers need nothing from the controller between steps, so the next step
            # is sent as soon as this one is done (unless a checkpoint comes first) and
            # the logging overlaps it. A step's time runs from its predecessor's end
            # (or its own start after a checkpoint) to its own end.
            t0 = time.perf_counter()
            if not finished:
                self.broadcast(("step", start))
            for step in range(start, s.steps):
                replies = self.gather("done")
                now = time.perf_counter()
                wall, t0 = now - t0, now
                save = (step + 1) % s.checkpoint_interval == 0 or step + 1 == s.steps
                if not save:
                    self.broadcast(("step", step + 1))
                reports = [m[2] for m in replies.values()]
                row = merge_metrics(step, reports, wall)
                self.unsaved_lines.append(log.write(row, op_events(reports)))
                progress.update(step, row)
                if save:
                    self.save_checkpoint(step + 1)
                    if step + 1 < s.steps:
                        t0 = time.perf_counter()
                        self.broadcast(("step", step + 1))
            part = checkpoint.final_part(s.final_dir)
            if part.exists():
                shutil.rmtree(part)             # a killed run's half-written final model
            self.broadcast(("final", str(part)))
            self.gather("saved_final")
            checkpoint.seal_final(s.final_dir, s.steps)
            self.broadcast(("stop",))
            print(f"final {s.final_dir.name} saved to {s.final_dir}", file=self.out, flush=True)
            return 0
        except WorkerFailed as e:
            if e.message is not None:
                print(f"\nrealign run: stopped by worker {e.rank}: {e.message}\n(its traceback "
                      f"is in {s.run_dir / 'logs' / f'worker{e.rank}.log'})", file=sys.stderr,
                      flush=True)
            else:
                print(f"\nrealign run: worker {e.rank} failed:\n{e.detail}", file=sys.stderr,
                      flush=True)
            return 1
        finally:
            log.close()
            self.launcher.stop()

    def restore_metrics(self, start: int) -> None:
        """metrics.jsonl holds each of the ``start`` steps done exactly once: lines a
        damage cut off come back from the checkpoints' copies (said so); steps no
        checkpoint holds any more are named."""
        path = self.spec.run_dir / "metrics.jsonl"
        if start == 0 and not path.exists():
            return
        restored, lost = restore(path, start, checkpoint.saved_metrics(self.spec.run_dir))
        for step, name in restored:
            print(f"realign run: restored the metrics of step {step} from checkpoint {name}",
                  file=self.out, flush=True)
        if lost:
            print(f"realign run: the metrics of step(s) {', '.join(map(str, lost))} are lost "
                  "(metrics.jsonl's lines are damaged and no checkpoint keeps them)",
                  file=self.out, flush=True)

    def save_checkpoint(self, done_steps: int) -> None:
        s = self.spec
        tmp = checkpoint.tmp_dir(s.run_dir, done_steps)
        tmp.mkdir(parents=True, exist_ok=True)
        self.broadcast(("save", str(tmp)))
        lines = "".join(ln + "\n" for ln in self.unsaved_lines).encode()
        checkpoint.save_file(lines, tmp / checkpoint.METRICS)
        self.unsaved_lines = []
        files = {name: {"size": size, "sha256": sha}
                 for _, _, (name, size, sha) in self.gather("saved").values()}
        size, sha = checkpoint.bytes_digest(lines)
        files[checkpoint.METRICS] = {"size": size, "sha256": sha}
        checkpoint.commit(s.run_dir, done_steps, {
            "steps": done_steps, "workers": s.n_workers, "time": time.time(), "files": files,
            "distributed_optimizer": s.config.train.uses_distributed_optimizer(s.config.device),
            "trained": self.trained,
            # the ranks holding the rollout generated ahead (asynchronous plans)
            "in_flight_ranks": list(self.program.ahead_ranks) if done_steps < s.steps else []})


def _last_spans(reports: list[dict]) -> tuple[dict[int, float], dict[int, float]]:
    """Per op index: its last rank's start and its last rank's end (every rank reports
    its own ``spans``; before its peers arrive a rank only waits for them)."""
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for rep in reports:
        for i, t0, t1 in rep.get("spans", []):
            starts[i] = max(starts.get(i, t0), t0)
            ends[i] = max(ends.get(i, t1), t1)
    return starts, ends


def op_events(reports: list[dict]) -> list[list]:
    """The step's ops as ``[label, kind, start, end, gpus]``: named by their lead rank,
    timed from their last rank's start to their last rank's end."""
    starts, ends = _last_spans(reports)
    out = []
    for rep in reports:
        for i, label, kind, gpus, _metric in rep.get("ops", []):
            out.append([label, kind, starts[i], max(ends[i], starts[i]), gpus])
    return sorted(out, key=lambda e: e[2])


def op_times(reports: list[dict]) -> dict[str, float]:
    """``time.<mfc>`` and ``time.realloc.<mfc>``: each timed op's last rank's end minus
    its last rank's start."""
    starts, ends = _last_spans(reports)
    return {metric: max(0.0, ends[i] - starts[i]) for rep in reports
            for i, _label, _kind, _gpus, metric in rep.get("ops", []) if metric}


def merge_metrics(step: int, reports: list[dict], wall_s: float) -> dict:
    """One row per step from every worker's report: the union of what the ops' lead
    ranks reported (``metrics``), each timed op's duration (:func:`op_times`), the bytes
    each reallocation's ranks received summed (``realloc_bytes.<mfc>``, and
    ``realloc_bytes`` in all), and the mean of each ``dp_parts`` metric over the
    workers that reported it (one per data-parallel rank, equal shares of the batch)."""
    row: dict = {"step": step, "step_time_s": wall_s}
    row.update(op_times(reports))
    received: dict[str, float] = {}
    shares: dict[str, list[float]] = {}
    for rep in reports:
        for k, v in rep["metrics"].items():
            if k.startswith("realloc_bytes.") and ".r" in k:
                name = k.rsplit(".r", 1)[0]
                received[name] = received.get(name, 0.0) + v
            else:
                row[k] = v
        for k, v in rep["dp_parts"].items():
            shares.setdefault(k, []).append(v)
    row.update({k: sum(v) / len(v) for k, v in shares.items()})
    if received:
        row.update(received)
        row["realloc_bytes"] = sum(received.values())
    if "gen_tokens" in row and wall_s > 0:
        row["tokens_per_s"] = row["gen_tokens"] / wall_s
    return row
