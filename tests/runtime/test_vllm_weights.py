"""The weight update into vLLM without vLLM (realign.runtime.engines.vllm_weights): the
buckets of whole layers and their bound, the packing every transport shares (the
layout vLLM's packed transfer unpacks), the shared-memory transport's segment read back
by name as vLLM's workers read it, and a replica's weights delivered as the checkpoint
they were loaded from, bit for bit."""
from __future__ import annotations

import pytest
import torch

from realign.runtime.engines.vllm_weights import (
    Packed,
    SharedMemoryTransport,
    bucket_capacity,
    entry_from_wire,
    entry_to_wire,
    iter_wire,
    pack_into,
    plan_buckets,
    push_hf,
    push_weights,
    unpack,
)

pytestmark = pytest.mark.torch


def test_buckets_hold_whole_groups_within_the_bound():
    assert plan_buckets([4, 4, 9, 2, 2], 8) == [[0, 1], [2], [3, 4]]
    assert plan_buckets([3, 3, 3], 100) == [[0, 1, 2]]
    assert plan_buckets([], 8) == []
    assert bucket_capacity([4, 9], 8) == 9 and bucket_capacity([4, 4], 8) == 8
    sizes = [5, 1, 7, 3, 3, 3, 12, 1]
    buckets = plan_buckets(sizes, 8)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))     # in order, once
    cap = bucket_capacity(sizes, 8)
    assert all(sum(sizes[i] for i in b) <= cap for b in buckets)
    assert all(len(b) == 1 for b in buckets if sum(sizes[i] for i in b) > 8)


def test_packing_round_trips_mixed_dtypes_as_views():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1.5, -2.0, 3.25, 0.0], dtype=torch.bfloat16)
    c = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()        # not contiguous
    buf = torch.zeros(96, dtype=torch.uint8)
    entries = pack_into(buf, [("a", a), ("b", b), ("c", c)])
    assert [(e.offset, e.nbytes) for e in entries] == [(0, 24), (24, 8), (32, 48)]
    out = dict(unpack(buf, entries))
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b) and torch.equal(out["c"], c)
    assert out["a"].data_ptr() == buf.data_ptr()                        # a view, no copy
    # vLLM's unpacking of a packed chunk: split by sizes, view as dtype and shape
    parts = buf[:80].split([e.nbytes for e in entries])
    assert torch.equal(parts[2].view(torch.float32).view(4, 3), c)
    wire = [entry_to_wire(e) for e in entries]
    assert list(iter_wire(wire)) == entries and entry_from_wire(wire[1]) == entries[1]
    with pytest.raises(ValueError, match="does not fit"):
        pack_into(torch.zeros(30, dtype=torch.uint8), [("a", a), ("b", b)])


class Recorder:
    """A transport that keeps what it was sent (and checks begin/end bracket it)."""

    def __init__(self):
        self.buckets: list[list[tuple[str, torch.Tensor]]] = []
        self.state = "new"

    def begin(self):
        assert self.state == "new"
        self.state = "open"

    def send(self, tensors):
        assert self.state == "open"
        self.buckets.append([(n, t.clone()) for n, t in tensors])

    def end(self):
        self.state = "done"

    def close(self):
        pass


def hf_like(layers=3, width=8):
    g = torch.Generator().manual_seed(0)
    out = {"model.embed_tokens.weight": torch.randn(32, width, generator=g)}
    for i in range(layers):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"model.layers.{i}.self_attn.{part}.weight"] = torch.randn(width, width,
                                                                           generator=g)
        out[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(width, generator=g)
    out["model.norm.weight"] = torch.randn(width, generator=g)
    out["lm_head.weight"] = torch.randn(32, width, generator=g)
    return out


def test_a_bucket_never_splits_a_layer():
    hf = hf_like()
    layer_bytes = 4 * (4 * 64 + 8)
    rec = Recorder()
    nbytes = push_hf(hf, rec, bucket_bytes=layer_bytes + 10)     # one layer per bucket
    assert rec.state == "done" and nbytes == sum(t.numel() * 4 for t in hf.values())
    got = {n: t for b in rec.buckets for n, t in b}
    assert got.keys() == hf.keys() and all(torch.equal(got[n], hf[n]) for n in hf)
    for b in rec.buckets:
        layers = {n.split(".")[2] for n, _ in b if n.startswith("model.layers.")}
        assert len(layers) <= 1
    assert [n for n, _ in rec.buckets[0]] == ["model.embed_tokens.weight"]
    assert {n for n, _ in rec.buckets[-1]} == {"model.norm.weight", "lm_head.weight"}


def read_back(name, wire):
    """What a vLLM worker does with a bucket (realign_load_shm): map the segment by
    name, view its tensors; here copied out before the segment is closed."""
    from multiprocessing import resource_tracker, shared_memory

    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")
    try:
        buf = torch.frombuffer(shm.buf, dtype=torch.uint8)
        out = [(n, t.clone()) for n, t in unpack(buf, list(iter_wire(wire)))]
        del buf
        return out
    finally:
        shm.close()


def test_the_shared_memory_segment_carries_each_bucket_by_name():
    hf = hf_like(layers=2)
    calls: list = []
    seen: dict[str, torch.Tensor] = {}

    def rpc(method, args=()):
        calls.append(method)
        if args:
            seen.update(read_back(*args))
    t = SharedMemoryTransport(rpc, capacity_bytes=4 * (4 * 64 + 8) + 64)
    name = t.name
    assert name is not None
    try:
        push_hf(hf, t, bucket_bytes=4 * (4 * 64 + 8))
    finally:
        t.close()
    assert calls[0] == "realign_begin_update" and calls[-1] == "realign_end_update"
    assert calls.count("realign_load_shm") == 4        # embedding, 2 layers, norm + head
    assert all(torch.equal(seen[n], hf[n]) for n in hf) and seen.keys() == hf.keys()
    from multiprocessing import shared_memory
    with pytest.raises(FileNotFoundError):              # unlinked on close
        shared_memory.SharedMemory(name=name)
    assert SharedMemoryTransport(None, 100).name is None    # a rank that hosts no engine


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("model", ["llama", "llama_tied", "qwen3"])
def test_a_replica_is_delivered_as_its_checkpoint(world, tiny_models, model):
    from safetensors.torch import load_file

    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import load_hf_weights, spec_from_hf
    from realign.runtime.model import build_model

    path = tiny_models[model]
    spec = spec_from_hf(path)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1),
                                  Layout(tp=1, pp=1, dp=1))
    shard = build_model(spec, "lm", groups, init_device("cpu", dtype="fp32"), init_weights=False)
    load_hf_weights(shard, path)
    rec = Recorder()
    nbytes = push_weights(shard, rec, bucket_bytes=1)          # every group alone
    got = {n: t for b in rec.buckets for n, t in b}
    want = load_file(f"{path}/model.safetensors")
    if "lm_head.weight" in want and model == "llama_tied":
        want.pop("lm_head.weight")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n].float()) for n in want)
    assert nbytes == sum(t.numel() * 4 for t in want.values())
    assert len(rec.buckets) == spec.n_layers + 2


def test_cuda_ipc_reaches_the_replicas_own_gpus_only():
    from realign.runtime.engines.vllm_cuda_weights import cuda_backend

    assert cuda_backend([2, 3], [2, 3]) == "ipc"
    assert cuda_backend([2, 3], [3]) == "ipc"
    assert cuda_backend([2, 3], [6, 7]) == "nccl"


def test_packed_entries_are_plain_data():
    e = Packed("w", "float32", (2, 3), 0, 24)
    assert entry_to_wire(e) == ["w", "float32", [2, 3], 0, 24]
