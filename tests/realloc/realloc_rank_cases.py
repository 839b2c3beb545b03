"""Rank-side bodies of the CPU multi-process reallocation tests (run in LocalWorld
ranks; importable by name in the spawned processes)."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from planner.cost.transfer import Placement
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets
from realign.realloc import offload as off
from realign.realloc.executor import DIRECT_MIN_BYTES, allocate_shards, reallocate
from realign.realloc.naive import naive_reallocate
from realign.realloc.synthetic import full_weights, shards_of

SEED = 1234


def placement(first: int, n: int, tp: int, pp: int, dp: int) -> Placement:
    return Placement(DeviceMesh(first_gpu=first, n_gpus=n), Layout(tp=tp, pp=pp, dp=dp))


@functools.lru_cache(maxsize=8)
def _full(model: str, head: str):
    return full_weights(model_presets()[model], head, SEED)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def mismatches(got: dict, want: dict) -> list[str]:
    """Names whose tensors differ bit for bit (or are missing)."""
    if set(got) != set(want):
        return sorted(set(got) ^ set(want))
    return [n for n in sorted(want) if not torch.equal(_bits(got[n]), _bits(want[n]))]


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous (column-major) tensor, for 2-D tensors."""
    if t.dim() != 2:
        return t
    out = torch.empty(t.shape[::-1], dtype=t.dtype).t()
    out.copy_(t)
    assert not out.is_contiguous() or 1 in t.shape
    return out


def _nan_shards(spec, head, p, gpu, strided=False):
    d = allocate_shards(spec, head, p, gpu, torch.float32)
    for t in d.values():
        t.fill_(float("nan"))
    return {n: _strided(t) for n, t in d.items()} if strided else d


def _stats(s):
    return (s.bytes_sent, s.bytes_received, s.bytes_local, s.messages_sent, s.messages_received)


def case(ctx, model: str, head: str, src_t: tuple, dst_t: tuple, gpn: int,
         direct_min_bytes: int = DIRECT_MIN_BYTES, strided: bool = False) -> dict:
    """A -> B, check B against the reference; B -> A, check against A.

    ``strided``: every 2-D shard on both sides is a non-contiguous tensor.
    """
    spec, gpu = model_presets()[model], dist.get_rank()
    src, dst = placement(*src_t), placement(*dst_t)
    full = _full(model, head)
    a = shards_of(full, spec, head, src, gpu)
    if strided:
        a = {n: _strided(t) for n, t in a.items()}
    a_before = {n: t.clone() for n, t in a.items()}
    b = _nan_shards(spec, head, dst, gpu, strided)
    kw = dict(dtype=torch.float32, gpus_per_node=gpn, direct_min_bytes=direct_min_bytes)
    s1 = reallocate(spec, head, src, dst, a, b, **kw)
    back = _nan_shards(spec, head, src, gpu, strided)
    s2 = reallocate(spec, head, dst, src, b, back, **kw)
    return {"gpu": gpu,
            "dst_bad": mismatches(b, shards_of(full, spec, head, dst, gpu)),
            "back_bad": mismatches(back, a_before),
            "src_touched": mismatches(a, a_before),
            "fwd": _stats(s1), "bwd": _stats(s2)}


def only_involved(ctx, model: str, head: str, src_t: tuple, dst_t: tuple) -> dict:
    """Ranks outside src ∪ dst do not call the executor at all."""
    spec, gpu = model_presets()[model], dist.get_rank()
    src, dst = placement(*src_t), placement(*dst_t)
    if gpu not in src.mesh.gpus and gpu not in dst.mesh.gpus:
        return {"gpu": gpu, "called": False, "dst_bad": []}
    full = _full(model, head)
    b = _nan_shards(spec, head, dst, gpu)
    reallocate(spec, head, src, dst, shards_of(full, spec, head, src, gpu), b,
               dtype=torch.float32, gpus_per_node=4)
    return {"gpu": gpu, "called": True,
            "dst_bad": mismatches(b, shards_of(full, spec, head, dst, gpu))}


def bad_input(ctx, model: str, src_t: tuple, dst_t: tuple) -> None:
    spec = model_presets()[model]
    src, dst = placement(*src_t), placement(*dst_t)
    reallocate(spec, "lm", src, dst, {}, {}, dtype=torch.float32, gpus_per_node=4)


def naive_case(ctx, model: str, head: str, src_t: tuple, dst_t: tuple) -> dict:
    spec, gpu = model_presets()[model], dist.get_rank()
    src, dst = placement(*src_t), placement(*dst_t)
    full = _full(model, head)
    b = _nan_shards(spec, head, dst, gpu)
    naive_reallocate(spec, head, src, dst, shards_of(full, spec, head, src, gpu), b,
                     dtype=torch.float32)
    return {"gpu": gpu, "dst_bad": mismatches(b, shards_of(full, spec, head, dst, gpu))}


def release_refill(ctx, model: str, head: str, src_t: tuple, dst_t: tuple) -> dict:
    """The generation copy is released after use, then restored and refilled."""
    spec, gpu = model_presets()[model], dist.get_rank()
    src, dst = placement(*src_t), placement(*dst_t)
    full = _full(model, head)
    a = shards_of(full, spec, head, src, gpu)
    b = _nan_shards(spec, head, dst, gpu)
    views = {n: t[...] for n, t in b.items()}   # the runtime hands us views
    reallocate(spec, head, src, dst, a, views, dtype=torch.float32, gpus_per_node=4)
    rel = off.release(b.values())
    sizes_after_release = sorted({t.untyped_storage().nbytes() for t in b.values()})
    off.restore(rel)
    for t in b.values():
        t.fill_(float("nan"))
    reallocate(spec, head, src, dst, a, views, dtype=torch.float32, gpus_per_node=4)
    return {"gpu": gpu, "freed": rel.total_bytes,
            "expected_bytes": sum(t.numel() * 4 for t in b.values()),
            "sizes_after_release": sizes_after_release,
            "dst_bad": mismatches(b, shards_of(full, spec, head, dst, gpu))}
