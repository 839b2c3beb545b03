"""``python -m realign.worker.zygote``: imports a worker's modules once, then forks
each worker of a run from that state (the local launcher's preloaded start).

Nearly all of a tiny worker's start is imports (torch, megatron-core, transformers'
tokenizer path, realign's runtime: docs/testing.md). The zygote imports them once,
with the environment every worker of the run shares (offline flags, thread counts),
and a worker forked from it starts with them loaded. It reads one JSON request a line
on stdin, ``{"env": {...}, "log": PATH}``, and answers on stdout, one line each:
``started PID`` when it has forked that worker, ``exit PID CODE`` when the worker has
ended (``CODE`` as :attr:`subprocess.Popen.returncode`: negative for a signal). A
forked worker leads its own session (its process group holds what it starts), writes
stdout and stderr to its log, reads nothing on stdin, adds its ``env`` to the
environment and sets torch's threads from ``OMP_NUM_THREADS`` before it runs
:func:`realign.worker.main.main`. The zygote runs no torch operation, so it holds no
thread pool when it forks. It ignores SIGINT and SIGTERM (the controller's process
group's signals are the controller's to handle); its workers do not. It leaves when
stdin closes and every worker it forked has ended; if its parent is gone it keeps
reaping its workers and stops reporting.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
import traceback

# the modules a worker imports before it serves (realign/worker/main.py's serve and
# what its Session builds); megatron-core is imported by import_megatron, first
PRELOAD_MODULES = (
    "torch",
    "torch.distributed",
    "torch._dynamo",                 # imported by torch's first optimizer otherwise
    "transformers",
    "realign.run.spec",
    "realign.runtime.polled_wait",
    "realign.worker.rendezvous",
    "realign.worker.session",
    "realign.worker.main",
)
# transformers' lazily imported names a worker's tokenizer and models reach
PRELOAD_TRANSFORMERS = ("PreTrainedTokenizerFast",)
POLL_S = 0.05


def preload() -> None:
    """Import what every worker needs (megatron-core with its compilation deferred)."""
    from realign.runtime.megatron_import import import_megatron

    import_megatron()
    for name in PRELOAD_MODULES:
        importlib.import_module(name)
    transformers = importlib.import_module("transformers")
    for name in PRELOAD_TRANSFORMERS:
        getattr(transformers, name)


def run_worker(env: dict[str, str], log_path: str) -> None:
    """In the forked child: become the worker and never return."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)    # Python's defaults
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.update(env)
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        from realign.worker.main import main

        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:        # noqa: BLE001 (the child must never return to the loop)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:    # noqa: BLE001, S110 (a closed log: nothing to keep)
                pass
        os._exit(code)


def exit_code(status: int) -> int:
    """A ``waitpid`` status as :attr:`subprocess.Popen.returncode`."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class Reporter:
    """Lines to the parent on their own descriptor (``fd``: the zygote's stdout as it
    started; file descriptor 1 itself is pointed at the zygote's log, so that what an
    imported module prints never reaches the parent as a report); once the parent is
    gone, nothing (the reaping goes on)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.gone = False

    def say(self, line: str) -> None:
        if self.gone:
            return
        try:
            os.write(self.fd, (line + "\n").encode())
        except OSError:                 # BrokenPipeError among them
            self.gone = True


def serve(out: Reporter) -> None:
    """Fork a worker per request line; report starts and exits; end when stdin is
    closed and no worker is left."""
    alive: set[int] = set()
    reading = True
    buffered = b""
    while reading or alive:
        if reading:
            ready, _, _ = select.select([0], [], [], POLL_S)
            if ready:
                chunk = os.read(0, 65536)
                reading = bool(chunk)
                buffered += chunk
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    req = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        os.close(out.fd)    # the parent's pipe ends with the zygote
                        run_worker(req["env"], req["log"])
                    alive.add(pid)
                    out.say(f"started {pid}")
        else:
            select.select([], [], [], POLL_S)
        while alive:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            alive.discard(pid)
            out.say(f"exit {pid} {exit_code(status)}")


def main() -> int:
    # a signal to the controller's process group (Ctrl-C, a job's cancel) is the
    # controller's to handle: it stops the workers, and this process then leaves
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    out = Reporter(os.dup(1))
    os.dup2(2, 1)                       # what preloaded modules print goes to the log
    preload()
    out.say("ready")
    serve(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
