"""``python -m realign.worker.main``: one worker process (one device).

Joins the controller (address and key in the environment), receives the set-up,
joins the gloo/NCCL world, builds its replicas, then serves commands: ``step``,
``save``, ``final``, ``stop``. Any exception is reported to the controller with its
traceback before the process exits non-zero. A second connection carries heartbeats
and ends the worker when the controller is gone (:mod:`realign.worker.watchdog`).
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from multiprocessing.connection import Client

from realign.worker.watchdog import Position, stall_hook, tracked_waits, watch


def serve(conn, rank: int, world: int, position: Position) -> None:
    from realign.run.spec import RunSpec
    from realign.runtime.megatron_import import import_megatron
    from realign.runtime.polled_wait import polled_waits
    from realign.worker.rendezvous import join_store
    from realign.worker.session import Session
    import_megatron()         # before any other import of it: see megatron_import.py
    msg = conn.recv()
    assert msg[0] == "setup", msg
    spec = RunSpec.model_validate_json(msg[1])
    position.timeout_of = spec.call_timeout_s
    store = join_store(conn, rank, world, spec.collective_timeout_s())
    session = Session(spec, rank, world, store, resume_dir=msg[2])
    session.runner.position = position
    session.runner.stall = stall_hook(os.environ)
    conn.send(("ready", rank))
    # gloo on CPU: poll collectives rather than sleep in them (see polled_wait.py)
    with polled_waits() if session.dev.kind == "cpu" else contextlib.nullcontext(), \
            tracked_waits(position):
        _commands(conn, session, rank)


def _commands(conn, session, rank: int) -> None:
    while True:
        msg = conn.recv()
        if msg[0] == "step":
            conn.send(("done", msg[1], session.step(msg[1])))
        elif msg[0] == "save":
            conn.send(("saved", rank, session.save(msg[1])))
        elif msg[0] == "final":
            session.save_final(msg[1])
            conn.send(("saved_final", rank))
        elif msg[0] == "stop":
            session.close()
            return
        else:
            raise ValueError(f"unknown command {msg[0]!r}")


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["REALIGN_CONTROLLER"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["REALIGN_AUTHKEY"]))
    conn.send(("hello", rank))
    # the second connection: heartbeats, and an exit when the controller is gone
    position = Position()
    beats = Client((host, int(port)), authkey=bytes.fromhex(os.environ["REALIGN_AUTHKEY"]))
    beats.send(("watch", rank))
    watch(beats, rank, position)
    try:
        serve(conn, rank, world, position)
        return 0
    except BaseException as e:
        from realign.errors import UserError

        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        # a user's error (bad reward value, non-finite loss, ...) is reported as its
        # message alone; anything else with its traceback
        message = str(e) if isinstance(e, UserError) else None
        try:
            conn.send(("error", tb, message))
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
