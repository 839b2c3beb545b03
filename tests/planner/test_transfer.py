"""The exact transfer plan of a reallocation against the closed form the search prices,
and against a lower bound computed here, independently, from the parameter layout.

For random placement pairs (meshes on 1-2 nodes of 2/4/8 GPUs, every valid tp/pp/dp,
LLaMA / tied Qwen / 8-layer models, LM and value heads):
* per destination GPU, (intra, inter) bytes received are identical in
  planner.cost.realloc_cost and planner.cost.transfer;
* bytes moved equal the lower bound (each destination's needed bytes it lacks locally);
* the copies cover every destination slice exactly once, never send a receiver what it
  held, always come from a GPU that holds the slice, and from the receiver's node
  whenever a holder is there.
"""
from __future__ import annotations

import random
from collections import defaultdict

import pytest

from planner.cost.realloc_cost import ReallocModel, realloc_recv_send
from planner.cost.transfer import Placement, transfer_plan
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout, enumerate_layouts
from planner.specs.mesh import DeviceMesh, enumerate_meshes
from planner.specs.model_spec import ModelSpec, model_presets
from planner.specs.param_layout import LogicalTensor, stage_tensors

pytestmark = pytest.mark.pure

DT = 2
MODELS = ("tiny-llama", "tiny-qwen", "tiny-llama-8l")
N_PAIRS = 240

Interval = tuple[int, int]


# ---- an independent model of who holds what ------------------------------------------

def coords(place: Placement, gpu: int) -> tuple[int, int, int] | None:
    """(tp rank, dp rank, pp rank) of a global GPU in a placement, None if outside."""
    r = gpu - place.mesh.first_gpu
    if not 0 <= r < place.mesh.n_gpus:
        return None
    tp, dp = place.layout.tp, place.layout.dp
    return r % tp, (r // tp) % dp, r // (tp * dp)


def intervals(t: LogicalTensor, tp_rank: int, tp: int) -> list[Interval]:
    """Indices along the shard dim a TP rank holds: each of the ``parts`` blocks split in tp."""
    if t.shard_dim is None:
        return [(0, 1)]     # a replicated tensor: one indivisible unit
    n = t.shape[t.shard_dim]
    block = n // t.parts
    return [(p * block + tp_rank * block // tp, p * block + (tp_rank + 1) * block // tp)
            for p in range(t.parts)]


def unit_bytes(t: LogicalTensor) -> int:
    """Bytes of one index along the shard dim (the whole tensor when replicated)."""
    n = 1
    for k, s in enumerate(t.shape):
        if k != t.shard_dim:
            n *= s
    return n * DT


def holdings(spec: ModelSpec, head: str, place: Placement, gpu: int
             ) -> dict[str, tuple[LogicalTensor, list[Interval]]]:
    """content -> (tensor, intervals) a GPU holds in a placement."""
    c = coords(place, gpu)
    if c is None:
        return {}
    k, _d, j = c
    return {t.content: (t, intervals(t, k, place.layout.tp))
            for t in stage_tensors(spec, head, place.layout.pp, j)}


def measure(ivs: list[Interval]) -> int:
    pts = sorted(ivs)
    total, cur_lo, cur_hi = 0, None, None
    for lo, hi in pts:
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi is not None:
        total += cur_hi - cur_lo
    return total


def minus(a: list[Interval], b: list[Interval]) -> int:
    """Measure of the union of a minus the union of b."""
    inter = [(max(x, y), min(z, w)) for x, z in a for y, w in b if max(x, y) < min(z, w)]
    return measure(a) - measure(inter)


def lower_bound(spec, head, src: Placement, dst: Placement) -> dict[int, int]:
    """Per destination GPU, the bytes of its needed slices it does not hold locally."""
    out = {}
    for r in range(dst.mesh.n_gpus):
        g = dst.mesh.first_gpu + r
        have = holdings(spec, head, src, g)
        lack = 0
        for content, (t, need) in holdings(spec, head, dst, g).items():
            held = have[content][1] if content in have else []
            lack += minus(need, held) * unit_bytes(t)
        out[g] = lack
    return out


# ---- random placements ----------------------------------------------------------------

def random_case(rng: random.Random):
    presets = model_presets()
    spec = presets[rng.choice(MODELS)]
    head = rng.choice(("lm", "value"))
    gpn = rng.choice((2, 4, 8))
    cluster = ClusterSpec(n_nodes=rng.choice((1, 2)), gpus_per_node=gpn,
                          device=resolve_device("a100-80g"))
    probe = MFC(name="actor.inference", role="actor", kind="inference", n_seqs=64,
                prompt_len=8, gen_len=8, input_keys=("d",), output_keys=("o",))
    meshes = enumerate_meshes(cluster)

    def place() -> Placement:
        m = rng.choice(meshes)
        return Placement(m, rng.choice(enumerate_layouts(m, spec, probe, cluster)))

    return spec, head, gpn, place(), place()


def pl(p: Placement) -> tuple[int, int, int, int, int]:
    return (p.mesh.first_gpu, p.mesh.n_gpus, p.layout.tp, p.layout.pp, p.layout.dp)


@pytest.fixture(scope="module")
def cases():
    rng = random.Random(2024)
    out = [random_case(rng) for _ in range(N_PAIRS)]
    return [(spec, head, gpn, src, dst, transfer_plan(spec, head, src, dst, gpn, DT))
            for spec, head, gpn, src, dst in out]


def test_cases_cover_the_interesting_shapes(cases):
    assert {c[0].name for c in cases} == set(MODELS)
    assert {c[1] for c in cases} == {"lm", "value"}
    assert any(s.layout.tp != d.layout.tp for _, _, _, s, d, _ in cases)
    assert any(s.layout.pp != d.layout.pp and min(s.layout.pp, d.layout.pp) > 1
               for _, _, _, s, d, _ in cases)
    assert any(s.mesh.overlaps(d.mesh) and s.mesh != d.mesh for _, _, _, s, d, _ in cases)
    assert sum(any(v[1] for v in plan.recv_bytes(gpn).values())
               for _, _, gpn, _, _, plan in cases) > 20          # inter-node traffic
    assert sum(c[0].tied_embeddings and c[1] == "lm" and c[4].layout.pp > 1
               for c in cases) > 5


def test_closed_form_receives_exactly_what_the_plan_sends(cases):
    for spec, head, gpn, src, dst, plan in cases:
        acc = realloc_recv_send(ReallocModel.of(spec, head, DT), pl(src), pl(dst), gpn)
        closed = {g: tuple(v) for g, v in acc.recv.items() if any(v)}
        exact = {g: v for g, v in plan.recv_bytes(gpn).items() if any(v)}
        assert closed == exact, (spec.name, head, pl(src), pl(dst))


def test_bytes_moved_equal_the_lower_bound(cases):
    n_nonzero = 0
    for spec, head, gpn, src, dst, plan in cases:
        lb = lower_bound(spec, head, src, dst)
        recv = plan.recv_bytes(gpn)
        assert {g: sum(recv.get(g, (0, 0))) for g in lb} == lb, (spec.name, pl(src), pl(dst))
        assert plan.bytes_moved() == sum(lb.values())
        assert set(recv) <= set(lb)
        n_nonzero += plan.bytes_moved() > 0
    assert n_nonzero > N_PAIRS // 2


def test_copies_cover_each_destination_slice_exactly_once(cases):
    for spec, head, _gpn, _src, dst, plan in cases:
        got: dict[tuple[int, str], list] = defaultdict(list)
        for c in plan.copies:
            got[(c.dst_gpu, c.dst_tensor)].append(c)
        want = {}
        for r in range(dst.mesh.n_gpus):
            g = dst.mesh.first_gpu + r
            for _content, (t, need) in holdings(spec, head, dst, g).items():
                want[(g, t.name)] = (t, need)
        assert set(got) == set(want)
        for key, (t, need) in want.items():
            cs = got[key]
            if t.shard_dim is None:
                assert len(cs) == 1 and cs[0].dim is None
                assert cs[0].nbytes == unit_bytes(t)
                continue
            assert all(c.dim == t.shard_dim for c in cs)
            ivs = sorted((c.start, c.stop) for c in cs)
            # pairwise disjoint (nothing sent twice) ...
            assert all(a[1] <= b[0] for a, b in zip(ivs, ivs[1:])), key
            # ... and together exactly the needed indices
            assert measure(ivs) == measure(need) == sum(hi - lo for lo, hi in ivs)
            assert minus(need, ivs) == 0
            assert all(c.nbytes == (c.stop - c.start) * unit_bytes(t) for c in cs)


def test_senders_hold_the_slice_and_receivers_lacked_it(cases):
    for spec, head, gpn, src, _dst, plan in cases:
        src_gpus = list(src.mesh.gpus)
        for c in plan.copies:
            held = holdings(spec, head, src, c.src_gpu)
            by_name = {t.name: (t, ivs) for t, ivs in held.values()}
            assert c.src_tensor in by_name            # the sender holds that tensor
            t, ivs = by_name[c.src_tensor]
            if c.dim is not None:
                assert minus([(c.start, c.stop)], ivs) == 0   # ... and that slice
            if c.is_local:
                continue
            mine = holdings(spec, head, src, c.dst_gpu).get(t.content)
            if mine is not None:
                if c.dim is None:
                    raise AssertionError(f"GPU {c.dst_gpu} was sent {c.dst_tensor} it held")
                assert minus([(c.start, c.stop)], mine[1]) == c.stop - c.start
            # an inter-node copy only when no holder sits on the receiver's node
            if c.src_gpu // gpn != c.dst_gpu // gpn:
                node = c.dst_gpu // gpn
                for g in src_gpus:
                    if g // gpn != node:
                        continue
                    h = holdings(spec, head, src, g).get(t.content)
                    if h is not None and c.dim is not None:
                        assert minus([(c.start, c.stop)], h[1]) == c.stop - c.start
                    assert not (h is not None and c.dim is None)


def test_same_placement_moves_nothing(cases):
    for spec, head, gpn, src, _dst, _plan in cases[:60]:
        plan = transfer_plan(spec, head, src, src, gpn, DT)
        assert plan.bytes_moved() == 0 and plan.remote == [] and plan.copies
        acc = realloc_recv_send(ReallocModel.of(spec, head, DT), pl(src), pl(src), gpn)
        assert not any(any(v) for v in acc.recv.values())


def test_a_worked_example():
    """tiny-llama from TP2 on GPUs 0-1 to TP1 on GPU 2 (same node): GPU 2 receives
    every parameter once, half from each source GPU's shards of the split tensors."""
    spec = model_presets()["tiny-llama"]
    src = Placement(DeviceMesh(first_gpu=0, n_gpus=2), Layout(tp=2))
    dst = Placement(DeviceMesh(first_gpu=2, n_gpus=1), Layout())
    plan = transfer_plan(spec, "lm", src, dst, 4, DT)
    assert plan.bytes_moved() == spec.total_params("lm") * DT
    assert plan.recv_bytes(4) == {2: (spec.total_params("lm") * DT, 0)}
    sent = defaultdict(int)
    for c in plan.remote:
        sent[c.src_gpu] += c.nbytes
    assert sent[0] + sent[1] == plan.bytes_moved()
    # split tensors come half from each; replicated ones go to the least-loaded GPU
    assert abs(sent[0] - sent[1]) <= max(c.nbytes for c in plan.remote if c.dim is None)
