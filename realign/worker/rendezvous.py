"""Where a run's workers meet: the gloo/NCCL world's key-value store.

Rank 0 serves the store on a port the operating system assigns while binding it
(port 0), and tells the others through the controller, which relays it (``("store",
port)``). Choosing a free port first and binding it later is a race: another process
can take the port in between (an outgoing connection's ephemeral port, another run),
and the world then fails to form with EADDRINUSE. A launcher that names a port
(``MASTER_PORT`` not 0: a cluster whose firewall allows only some) gets exactly that
port.
"""
from __future__ import annotations

import datetime
import os


def join_store(conn, rank: int, world: int, timeout_s: float):
    """The world's store for ``rank``: served by rank 0 (which reports its port on
    ``conn``), reached by the others (who wait on ``conn`` for the port)."""
    from torch.distributed import TCPStore

    addr = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if port == 0 and rank == 0:
        store = TCPStore(addr, 0, world, is_master=True, timeout=timeout,
                         wait_for_workers=False)
        conn.send(("store", store.port))
        return store
    if port == 0:
        msg = conn.recv()
        if msg[0] != "store":
            raise RuntimeError(f"expected the store's port from the controller, got {msg[0]!r}")
        port = int(msg[1])
    return TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout,
                    wait_for_workers=False)
