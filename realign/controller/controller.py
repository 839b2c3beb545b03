"""The controller: starts the workers, hands them the plan, drives the steps, writes
metrics and checkpoints, and stops everything when a worker fails.

Only small messages pass through it (commands, metrics, tracebacks); tensors move
worker to worker. A failed worker is named with its traceback (or the tail of its
log when it died without one), the others are stopped, and ``run`` returns 1 within
seconds; nothing waits forever on a dead peer. A call that runs past its time limit
is named with the ranks that hold it up (:mod:`realign.controller.hangs`, from the
workers' heartbeats), and ``run`` returns 1. A stop signal makes the run finish its
step, checkpoint and return 3 (:mod:`realign.controller.stopping`).
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

from realign.controller.hangs import Beat, HangWatch
from realign.controller.metrics import MetricsLog, Progress, restore
from realign.controller.step_report import merge_metrics, op_events
from realign.controller.stopping import EXIT_PREEMPTED, StopNow, StopRequest
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


class CallTimedOut(Exception):
    """A call ran past its time limit: the message names it and who holds it up."""


class Controller:
    def __init__(self, spec: RunSpec, launcher: Launcher, out=None):
        self.spec, self.launcher = spec, launcher
        self.out = out or sys.stdout
        self.conns: dict[int, Connection] = {}
        #: each worker's second connection: its heartbeats (realign.worker.watchdog)
        self.watches: dict[int, Connection] = {}
        self.hangs = HangWatch()
        self.stop = StopRequest()
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
            for conn in wait(pending + list(self.watches.values()), timeout=POLL_S):
                if conn not in pending:
                    assert isinstance(conn, Connection), "wait() returns what it was given"
                    self._beat(conn)
                    continue
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
            self._check_progress()
        return got

    def _beat(self, conn: Connection) -> None:
        try:
            self.hangs.observe(Beat.of(conn.recv()))
        except (EOFError, OSError):          # the worker is gone: its exit is reported
            self.watches = {r: c for r, c in self.watches.items() if c is not conn}

    def _check_progress(self) -> None:
        """Fail on a call past its time limit; say once that a stop was asked for."""
        hang = self.hangs.overdue(time.monotonic())
        if hang is not None:
            raise CallTimedOut(hang)
        if self.stop.requested and not self.stop.noted:
            self.stop.noted = True
            print(f"realign run: {self.stop.name}: finishing the step, then a checkpoint "
                  "and exit 3 (another signal stops at once)", file=self.out, flush=True)

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
        # Listener keeps its socket private; accept() needs its timeout to poll the workers
        self.listener._listener._socket.settimeout(POLL_S)  # type: ignore[attr-defined]
        while len(self.conns) < s.n_workers or len(self.watches) < s.n_workers:
            if time.monotonic() > deadline:
                raise WorkerFailed(-1, f"only {len(self.conns)} of {s.n_workers} workers "
                                       f"connected within {ACCEPT_TIMEOUT_S:.0f} s")
            try:
                conn = self.listener.accept()
            except (socket.timeout, TimeoutError):
                self._check_exits()
                continue
            kind, rank = conn.recv()
            (self.watches if kind == "watch" else self.conns)[rank] = conn

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
        """Train to the end (0), or until a stop signal (3), a failure or a hang (1)."""
        with self.stop.installed():
            return self._run()

    def _run(self) -> int:
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
        grace_s = 5.0
        try:
            if resume:
                print(f"resuming from {resume[1]} (step {start})", file=self.out, flush=True)
            if finished:
                assert resume is not None, "steps done imply a checkpoint to resume from"
                print(f"all {s.steps} steps are done, but final {s.final_dir.name} is missing "
                      f"or incomplete: writing it again from {resume[1].name}", file=self.out,
                      flush=True)
            self.start_workers()
            self.broadcast(("setup", s.model_dump_json(), str(resume[1]) if resume else None))
            self.relay_store_port()
            self.gather("ready")
            if not finished:
                done = self.train(start, log)
                if done < s.steps:
                    self.broadcast(("stop",))
                    return self._stopped(done)
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
        except CallTimedOut as e:
            print(f"\nrealign run: {e}; the workers are stopped (exit 1)", file=sys.stderr,
                  flush=True)
            return 1
        except StopNow as e:
            grace_s = 0.0
            last = checkpoint.latest(s.run_dir)
            print(f"\nrealign run: {e}: workers killed; "
                  + (f"the last complete checkpoint is {last[1].name}" if last else
                     "no checkpoint yet") + "; run the same command again to resume "
                  f"(exit {EXIT_PREEMPTED}: preempted, resumable)", file=self.out, flush=True)
            return EXIT_PREEMPTED
        finally:
            self.stop.ignore_more()
            log.close()
            self.launcher.stop(grace_s)

    def train(self, start: int, log: MetricsLog) -> int:
        """Run steps ``start`` .. ``run.steps - 1``, checkpointing every
        ``run.checkpoint_interval`` steps and after the last one; a stop signal ends it
        after the step in flight and its checkpoint. Returns the steps done."""
        s = self.spec
        if self.stop.requested:                   # asked during set-up: nothing to save
            return start
        progress = Progress(s.steps, start, self.out)
        # Workers need nothing from the controller between steps, so the next step is
        # sent as soon as this one is done (unless a checkpoint comes first) and the
        # logging overlaps it. A step's time runs from its predecessor's end (or its own
        # start after a checkpoint) to its own end.
        t0 = time.perf_counter()
        self.broadcast(("step", start))
        for step in range(start, s.steps):
            replies = self.gather("done")
            now = time.perf_counter()
            wall, t0 = now - t0, now
            save = ((step + 1) % s.checkpoint_interval == 0 or step + 1 == s.steps
                    or self.stop.requested)
            if not save:
                self.broadcast(("step", step + 1))
            reports = [m[2] for m in replies.values()]
            row = merge_metrics(step, reports, wall)
            self.unsaved_lines.append(log.write(row, op_events(reports)))
            progress.update(step, row)
            if save:
                self.save_checkpoint(step + 1)
                if self.stop.requested:
                    return step + 1
                if step + 1 < s.steps:
                    t0 = time.perf_counter()
                    self.broadcast(("step", step + 1))
        return s.steps

    def _stopped(self, done: int) -> int:
        """Say how a run stopped by a signal resumes; the exit code."""
        last = checkpoint.latest(self.spec.run_dir)
        where = f"checkpoint {last[1].name}" if last else "the start (no checkpoint yet)"
        print(f"realign run: stopped by {self.stop.name} after step {done} of "
              f"{self.spec.steps}; resumes from {where}: run the same command again "
              f"(exit {EXIT_PREEMPTED}: preempted, resumable)", file=self.out, flush=True)
        return EXIT_PREEMPTED

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
