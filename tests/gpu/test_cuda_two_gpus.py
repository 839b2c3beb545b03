"""The CUDA path on two GPUs (`make test-gpu` on a machine with two): an NCCL
reallocation between layouts and a record transfer over the world group's gloo side,
in a world of two processes whose group is ``cpu:gloo,cuda:nccl`` as in a run."""
from __future__ import annotations

import socket

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from planner.cost.transfer import Placement
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from planner.specs.model_spec import model_presets
    from realign.realloc.executor import allocate_shards, reallocate
    from realign.realloc.synthetic import full_weights, shards_of
    from realign.runtime.device import init_device
    from realign.worker.records import recv_record, send_record

    try:
        dev = init_device("cuda", local_rank=rank)
        dist.init_process_group(dev.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, device_id=dev.device)
        dist.barrier()
        spec = model_presets()["tiny-llama"]
        full = {k: v.to(torch.bfloat16) for k, v in full_weights(spec, "lm", seed=0).items()}
        src = Placement(DeviceMesh(first_gpu=0, n_gpus=2), Layout(tp=2))
        dst = Placement(DeviceMesh(first_gpu=1, n_gpus=1), Layout())
        a = {k: v.to(dev.device) for k, v in shards_of(full, spec, "lm", src, rank).items()}
        b = allocate_shards(spec, "lm", dst, rank, torch.bfloat16, dev.device)
        reallocate(spec, "lm", src, dst, a or None, b or None, dtype=torch.bfloat16,
                   gpus_per_node=2)
        want = shards_of(full, spec, "lm", dst, rank)
        exact = all(torch.equal(b[n].cpu(), want[n]) for n in want)
        record = {"tokens": torch.arange(12).view(3, 4), "note": "hello"}
        if rank == 0:
            send_record(record, 1)
            got = True
        else:
            rec = recv_record(0)
            got = (rec["note"] == "hello" and rec["tokens"].device.type == "cpu"
                   and torch.equal(rec["tokens"], record["tokens"]))
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, exact, got, None))
    except BaseException as e:  # reported to the test
        out.put((rank, False, False, repr(e)))


def test_nccl_reallocation_and_a_record_transfer():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(err is None for *_, err in results), results
    assert all(exact and got for _, exact, got, _ in results), results
