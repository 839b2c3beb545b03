"""The exact transfer plan of a parameter reallocation: which GPU sends which slice
of which tensor to which GPU, when a model moves from placement A to placement B.

Pure arithmetic, no processes: the runtime's executor carries out exactly this list
and the planner's cost (:mod:`planner.cost.realloc_cost`) prices the same bytes. Rules:

* a destination GPU that already holds a slice (it was in A with that shard) copies
  it locally and receives nothing for it;
* every other destination slice is sent exactly once, by a holder on the same node
  when one exists, else by any holder; among eligible holders the one with the
  fewest bytes assigned so far sends (ties: lowest GPU), spreading load over DP
  replicas.

So the bytes moved equal the lower bound: the bytes each destination lacks locally.

With expert parallelism (``layout.ep`` > 1) a GPU holds only its EP rank's experts
(:func:`held_tensors`), so a change of EP moves expert shards like any other slice.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from planner.specs.layout import Layout, coords_of_rank
from planner.specs.lora import LoraSpec, moved_stage_tensors
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import LogicalTensor


@dataclass(frozen=True)
class Placement:
    """Where a model's parameters live: a mesh and a layout (micro-batches aside)."""

    mesh: DeviceMesh
    layout: Layout

    def gpu_coords(self) -> list[tuple[int, int, int, int]]:
        """(global gpu, tp_rank, dp_rank, pp_rank) for every rank of the mesh."""
        return [(self.mesh.first_gpu + r, *coords_of_rank(r, self.layout))
                for r in range(self.mesh.n_gpus)]


@dataclass(frozen=True)
class SliceCopy:
    """Copy ``[start, stop)`` along ``dim`` of a tensor from one GPU to another.

    ``dim`` is None for a whole replicated tensor. ``src_gpu == dst_gpu`` is a local
    copy (no bytes on any link). Ranges are global indices of the full tensor.
    """

    src_gpu: int
    dst_gpu: int
    dst_tensor: str
    src_tensor: str
    dim: int | None
    start: int
    stop: int
    nbytes: int

    @property
    def is_local(self) -> bool:
        return self.src_gpu == self.dst_gpu


@dataclass
class TransferPlan:
    copies: list[SliceCopy] = field(default_factory=list)

    @property
    def remote(self) -> list[SliceCopy]:
        return [c for c in self.copies if not c.is_local]

    def bytes_moved(self) -> int:
        return sum(c.nbytes for c in self.remote)

    def recv_bytes(self, gpus_per_node: int) -> dict[int, tuple[int, int]]:
        """dst gpu -> (intra-node bytes received, inter-node bytes received)."""
        out: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for c in self.remote:
            inter = c.src_gpu // gpus_per_node != c.dst_gpu // gpus_per_node
            out[c.dst_gpu][int(inter)] += c.nbytes
        return {g: (v[0], v[1]) for g, v in out.items()}


_EXPERT = ".mlp.experts.local_experts."


def held_tensors(spec: ModelSpec, head: str, lora: LoraSpec | None, layout: Layout,
                 dp_rank: int, pp_rank: int) -> list[LogicalTensor]:
    """The tensors (each TP-sharded as its layout says) that the GPU at data-parallel
    rank ``dp_rank`` and stage ``pp_rank`` of ``layout`` holds, of those a reallocation
    moves (:func:`planner.specs.lora.moved_stage_tensors`): with expert parallelism,
    every tensor but the other EP ranks' experts (data-parallel rank ``d`` is EP rank
    ``d % ep``, holding experts ``(d % ep) E/ep .. (d % ep + 1) E/ep - 1``, as
    :mod:`realign.runtime.ep_groups` builds them). Example: 8 experts, dp 2, ep 2: dp
    rank 1 holds ``decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight`` and
    not ``...local_experts.3...``."""
    tensors = moved_stage_tensors(spec, head, lora, layout.pp, pp_rank)
    if layout.ep == 1 or spec.moe is None:
        return tensors
    per, mine = spec.moe.n_experts // layout.ep, dp_rank % layout.ep
    return [t for t in tensors if _EXPERT not in t.name
            or int(t.name.split(_EXPERT, 1)[1].split(".", 1)[0]) // per == mine]


def _elem_per_index(t: LogicalTensor) -> int:
    return t.numel // t.shape[t.shard_dim] if t.shard_dim is not None else t.numel


def transfer_plan(spec: ModelSpec, head: str, src: Placement, dst: Placement,
                  gpus_per_node: int, dtype_bytes: int,
                  lora: LoraSpec | None = None) -> TransferPlan:
    """The slice copies that turn placement ``src`` into placement ``dst`` (``lora``:
    only the trained tensors, :func:`planner.specs.lora.moved_stage_tensors`)."""
    # content -> [(gpu, tp_rank, tensor)] over every source GPU holding it
    holders: dict[str, list[tuple[int, int, LogicalTensor]]] = defaultdict(list)
    for gpu, k, d, j in src.gpu_coords():
        for t in held_tensors(spec, head, lora, src.layout, d, j):
            holders[t.content].append((gpu, k, t))
    sent: dict[int, int] = defaultdict(int)
    plan = TransferPlan()

    def choose(cands: list[int], dst_gpu: int) -> int:
        node = dst_gpu // gpus_per_node
        near = [g for g in cands if g // gpus_per_node == node]
        pool = near or cands
        return min(pool, key=lambda g: (sent[g], g))

    tp_s = src.layout.tp
    for dst_gpu, i, d, j in dst.gpu_coords():
        for t in held_tensors(spec, head, lora, dst.layout, d, j):
            hs = holders[t.content]
            per_index = _elem_per_index(t) * dtype_bytes
            if t.shard_dim is None:
                names = {g: st.name for g, _k, st in hs}
                if dst_gpu in names:
                    s = dst_gpu
                else:
                    s = choose(list(names), dst_gpu)
                    sent[s] += t.numel * dtype_bytes
                plan.copies.append(SliceCopy(s, dst_gpu, t.name, names[s], None, 0, 0,
                                             t.numel * dtype_bytes))
                continue
            need = t.shard_ranges(i, dst.layout.tp)
            for k in range(tp_s):
                names = {g: st.name for g, kk, st in hs if kk == k}
                held = t.shard_ranges(k, tp_s)
                gpus = list(names)
                for (a, b) in need:
                    for (c, d) in held:
                        lo, hi = max(a, c), min(b, d)
                        if lo >= hi:
                            continue
                        nbytes = (hi - lo) * per_index
                        if dst_gpu in gpus:
                            s = dst_gpu
                        else:
                            s = choose(gpus, dst_gpu)
                            sent[s] += nbytes
                        plan.copies.append(SliceCopy(s, dst_gpu, t.name, names[s],
                                                     t.shard_dim, lo, hi, nbytes))
    return plan
