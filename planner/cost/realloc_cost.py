"""Closed-form bytes and time of a parameter reallocation, fast enough for search.

Computes, for every destination GPU, the bytes it lacks locally and whether a holder
sits on its own node, with the same slice arithmetic and the same sender rule as
:func:`planner.cost.transfer.transfer_plan` (a test checks the per-GPU byte counts are
identical), but aggregated per pipeline-stage overlap instead of per tensor. The C++
core (``csrc/realloc_cost.cpp``) has a line-by-line twin of :func:`realloc_time`.

A mixture of experts' experts are split over TP like the dense MLP and, with expert
parallelism (a placement's ``ep``), over the EP ranks: data-parallel rank ``d`` holds
experts ``(d % ep) E/ep .. (d % ep + 1) E/ep - 1`` (:mod:`realign.runtime.ep_groups`).
A destination GPU needs its TP shard of its EP rank's experts; what overlaps with a
source (tp rank, EP rank)'s shard comes from the GPU itself when it held that shard,
else from the source GPUs holding it (the ranks of that tp rank whose dp rank is that EP
rank modulo the source's ep). So every destination receives exactly the bytes it needs
and does not hold: the byte lower bound, expert shards included. Each layer is priced at
its own kind's size: a sparse layer with its experts and router, a dense-MLP layer of the
same model (Qwen3-MoE's ``mlp_only_layers``) with its MLP (``ReallocModel.dense_layers``).

Time model (receiver- and sender-bound, links full duplex): a GPU receiving
``intra`` bytes from its own node and ``inter`` bytes from other nodes is busy
``intra/intra_bw + inter/inter_bw`` on the wire, plus ``(received + local) /
copy_bw`` for writing its destination shard (received slices are unpacked, slices it
already held are copied locally: both pass through memory once); each lacking piece
is charged evenly to the holders the transfer plan may pick from (own-node holders
when any exist), and a sender is busy likewise on the wire. The reallocation takes
the busiest GPU's time, plus one message latency when anything crosses the wire,
plus ``fixed_s`` (the executor's fixed work and the synchronisation of the ranks;
process groups are made once at start-up, never per reallocation). A reallocation
whose every slice is already local still pays ``fixed_s`` and its copies.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.specs.lora import LoraSpec
from planner.specs.model_spec import ModelSpec

HEAD_LM_UNTIED, HEAD_LM_TIED, HEAD_VALUE = 0, 1, 2


@dataclass(frozen=True)
class ReallocModel:
    """A model's parameter bytes by kind, the numbers the closed form needs."""

    n_layers: int
    #: TP-split bytes of one layer (full, unsharded; a mixture of experts: of a sparse
    #: layer, its experts aside)
    layer_sharded_bytes: int
    layer_replicated_bytes: int   #: bytes every TP rank of a stage holds per (sparse) layer
    embedding_bytes: int          #: vocab-parallel embedding (full)
    final_norm_bytes: int
    head_kind: int                #: HEAD_LM_UNTIED | HEAD_LM_TIED | HEAD_VALUE
    head_bytes: int               #: output layer (untied, sharded) or value head (replicated)
    #: the experts of one layer (full: every expert, unsharded; split over TP and EP),
    #: not among ``layer_sharded_bytes``; 0 for a dense model
    layer_expert_bytes: int = 0
    #: the layers of a mixture of experts that keep the dense MLP (increasing); they hold
    #: ``dense_layer_sharded_bytes`` and ``dense_layer_replicated_bytes`` and no experts,
    #: the other layers the three ``layer_*`` sizes; empty for a dense model
    dense_layers: tuple[int, ...] = ()
    dense_layer_sharded_bytes: int = 0     #: TP-split bytes of one dense layer (full)
    dense_layer_replicated_bytes: int = 0  #: bytes every TP rank holds per dense layer

    def dense_in(self, lo: int, hi: int) -> int:
        """How many of the layers ``lo .. hi - 1`` are dense layers."""
        return sum(1 for x in self.dense_layers if lo <= x < hi)

    @staticmethod
    def of(spec: ModelSpec, head: str, dtype_bytes: int,
           lora: LoraSpec | None = None) -> "ReallocModel":
        """``lora``: only the trained tensors move (the adapters, and a value head): the
        frozen base stays where it was placed (:func:`planner.specs.lora.moved_stage_tensors`).
        """
        if lora is not None:
            sharded, replicated = lora.layer_params(spec)
            return ReallocModel(
                n_layers=spec.n_layers, layer_sharded_bytes=sharded * dtype_bytes,
                layer_replicated_bytes=replicated * dtype_bytes, embedding_bytes=0,
                final_norm_bytes=0, head_kind=HEAD_VALUE if head == "value" else HEAD_LM_UNTIED,
                head_bytes=spec.head_params(head) * dtype_bytes if head == "value" else 0)
        kind = (HEAD_VALUE if head == "value"
                else HEAD_LM_TIED if spec.tied_embeddings else HEAD_LM_UNTIED)
        # each layer kind at its own size: a sparse layer (when there is one) with its
        # experts and router, the dense layers with their MLP
        dense = tuple(x for x in range(spec.n_layers) if not spec.is_sparse(x))
        one = next((x for x in range(spec.n_layers) if spec.is_sparse(x)), 0)
        d = dense[0] if dense and spec.sparse_layers() else one
        return ReallocModel(
            n_layers=spec.n_layers,
            layer_sharded_bytes=(spec.layer_sharded_params(one) - spec.layer_expert_params(one))
            * dtype_bytes,
            layer_replicated_bytes=spec.layer_replicated_params(one) * dtype_bytes,
            embedding_bytes=spec.embedding_params() * dtype_bytes,
            final_norm_bytes=spec.hidden * dtype_bytes,
            head_kind=kind,
            head_bytes=(spec.head_params(head) * dtype_bytes if kind != HEAD_LM_TIED else 0),
            layer_expert_bytes=spec.layer_expert_params(one) * dtype_bytes,
            dense_layers=dense if spec.sparse_layers() else (),
            dense_layer_sharded_bytes=spec.layer_sharded_params(d) * dtype_bytes,
            dense_layer_replicated_bytes=spec.layer_replicated_params(d) * dtype_bytes,
        )


@dataclass(frozen=True)
class Links:
    """Link rates the time model uses (from the cluster's device spec)."""

    gpus_per_node: int
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    intra_latency_s: float
    inter_latency_s: float
    fixed_s: float = 0.0               #: per reallocation (executor work, synchronisation)
    copy_bytes_per_s: float = float("inf")   #: writing the destination shards (memory)


# A placement in numbers: (first_gpu, n_gpus, tp, pp, dp, ep), or without ep (1).
Place = tuple[int, ...]


def _ep(p: Place) -> int:
    return p[5] if len(p) > 5 else 1


def _tp_overlap(i: int, tp_d: int, k: int, tp_s: int) -> int:
    """Overlap of shard i of tp_d and shard k of tp_s, in units of 1/(tp_d*tp_s)."""
    lo = max(i * tp_s, k * tp_d)
    hi = min((i + 1) * tp_s, (k + 1) * tp_d)
    return hi - lo if hi > lo else 0


class _Acc:
    """Per-GPU received and sent bytes (index 0: intra-node, 1: inter-node).

    A slice that reaches a GPU from another node is shared by every holder of it; such
    shares are summed per holder group (``far``: (stages, tp rank, EP rank) -> bytes
    per holder, in the order the groups first appear) and added to the group's holders once
    at the end, so a charge costs the holders on the receiver's node, not all of them
    (at 1024 GPUs a group holds up to 128 GPUs, and every receiver charged each)."""

    def __init__(self) -> None:
        self.recv: dict[int, list[int]] = {}
        self.send: dict[int, list[float]] = {}
        self.local: dict[int, int] = {}       #: bytes a destination GPU copies locally
        self.far: dict[tuple[tuple[int, ...], int, int], float] = {}


def _charge(acc: _Acc, g: int, group: tuple[tuple[int, ...], int, int], holders: list[int],
            nbytes: int, gpn: int) -> None:
    """``g`` receives ``nbytes`` of a slice held by ``holders`` (the holders of
    ``group``), shared evenly by those on ``g``'s node, or else by all of them."""
    node = g // gpn
    near = [h for h in holders if h // gpn == node]
    if near:
        acc.recv.setdefault(g, [0, 0])[0] += nbytes
        share = nbytes / len(near)
        for h in near:
            acc.send.setdefault(h, [0.0, 0.0])[0] += share
    else:
        acc.recv.setdefault(g, [0, 0])[1] += nbytes
        acc.far[group] = acc.far.get(group, 0.0) + nbytes / len(holders)


def _stages_holding(content: str, m: ReallocModel, pp: int, layer: int = -1) -> list[int]:
    if content == "layer":
        return [layer // (m.n_layers // pp)]
    if content == "embedding":
        return [0, pp - 1] if (m.head_kind == HEAD_LM_TIED and pp > 1) else [0]
    return [pp - 1]  # final norm, output layer, value head


def _holders(src: Place, stages: list[int], k: int, e: int = -1) -> list[int]:
    """Source GPUs at tp rank k (k < 0: any tp rank) of the given stages, and with
    ``e`` >= 0 only those of EP rank ``e`` (dp rank = e modulo the source's ep)."""
    first, _n, tp, _pp, dp = src[:5]
    ks = range(tp) if k < 0 else (k,)
    ds = range(dp) if e < 0 else range(e, dp, _ep(src))
    return [first + kk + tp * (d + dp * j) for j in stages for kk in ks for d in ds]


def realloc_recv_send(m: ReallocModel, src: Place, dst: Place, gpn: int) -> _Acc:
    """Bytes each GPU receives and sends when moving ``m`` from ``src`` to ``dst``."""
    acc = _Acc()
    s_first, s_n, tp_s, pp_s, dp_s = src[:5]
    d_first, d_n, tp_d, pp_d, dp_d = dst[:5]
    ep_s, ep_d = _ep(src), _ep(dst)
    L = m.n_layers
    unit = tp_d * tp_s
    for r in range(d_n):
        g = d_first + r
        i = r % tp_d
        j = r // (tp_d * dp_d)
        e = (r // tp_d) % dp_d % ep_d
        local = s_first <= g < s_first + s_n
        k_g = (g - s_first) % tp_s if local else -1
        j_g = (g - s_first) // (tp_s * dp_s) if local else -1
        e_g = (g - s_first) // tp_s % dp_s % ep_s if local else -1

        def sharded(nbytes: int, stages: list[int]) -> None:
            for k in range(tp_s):
                ov = _tp_overlap(i, tp_d, k, tp_s)
                if ov == 0:
                    continue
                if local and k_g == k and j_g in stages:
                    acc.local[g] = acc.local.get(g, 0) + nbytes * ov // unit
                    continue
                _charge(acc, g, (tuple(stages), k, -1), _holders(src, stages, k),
                        nbytes * ov // unit, gpn)

        def experts(nbytes: int, stages: list[int]) -> None:
            # TP shard i of EP rank e's experts: per source (tp rank, EP rank) overlap
            for k in range(tp_s):
                ov = _tp_overlap(i, tp_d, k, tp_s)
                if ov == 0:
                    continue
                for es in range(ep_s):
                    oe = _tp_overlap(e, ep_d, es, ep_s)
                    if oe == 0:
                        continue
                    part = nbytes * oe // (ep_d * ep_s) * ov // unit
                    if local and k_g == k and e_g == es and j_g in stages:
                        acc.local[g] = acc.local.get(g, 0) + part
                        continue
                    _charge(acc, g, (tuple(stages), k, es), _holders(src, stages, k, es),
                            part, gpn)

        def replicated(nbytes: int, stages: list[int]) -> None:
            if local and j_g in stages:
                acc.local[g] = acc.local.get(g, 0) + nbytes
                return
            _charge(acc, g, (tuple(stages), -1, -1), _holders(src, stages, -1), nbytes, gpn)

        if j == 0:
            sharded(m.embedding_bytes, _stages_holding("embedding", m, pp_s))
        d_lo, d_hi = j * (L // pp_d), (j + 1) * (L // pp_d)
        per_s = L // pp_s
        for js in range(d_lo // per_s, (d_hi - 1) // per_s + 1):
            lo, hi = max(d_lo, js * per_s), min(d_hi, (js + 1) * per_s)
            n_dense = m.dense_in(lo, hi)
            c = hi - lo - n_dense   # sparse layers (every layer of a dense model)
            sharded(m.layer_sharded_bytes * c + m.dense_layer_sharded_bytes * n_dense, [js])
            if m.layer_expert_bytes and c:
                experts(m.layer_expert_bytes * c, [js])
            replicated(m.layer_replicated_bytes * c + m.dense_layer_replicated_bytes * n_dense,
                       [js])
        if j == pp_d - 1:
            replicated(m.final_norm_bytes, [pp_s - 1])
            if m.head_kind == HEAD_LM_UNTIED:
                sharded(m.head_bytes, [pp_s - 1])
            elif m.head_kind == HEAD_VALUE:
                replicated(m.head_bytes, [pp_s - 1])
            elif pp_d > 1:
                sharded(m.embedding_bytes, _stages_holding("embedding", m, pp_s))
    for (stages, k, es), per_holder in acc.far.items():
        for h in _holders(src, list(stages), k, es):
            acc.send.setdefault(h, [0.0, 0.0])[1] += per_holder
    return acc


def realloc_time(m: ReallocModel, src: Place, dst: Place, links: Links) -> tuple[float, int]:
    """(seconds, bytes moved) to reallocate ``m`` from ``src`` to ``dst``."""
    acc = realloc_recv_send(m, src, dst, links.gpus_per_node)
    worst, total, any_inter = 0.0, 0, False
    for g in sorted(set(acc.recv) | set(acc.local)):
        a, b = acc.recv.get(g, [0, 0])
        c = acc.local.get(g, 0)
        total += a + b
        any_inter = any_inter or b > 0
        worst = max(worst, a / links.intra_bytes_per_s + b / links.inter_bytes_per_s
                    + (a + b + c) / links.copy_bytes_per_s)
    for h in sorted(acc.send):
        out_intra, out_inter = acc.send[h]
        worst = max(worst, out_intra / links.intra_bytes_per_s
                    + out_inter / links.inter_bytes_per_s)
    lat = 0.0
    if total > 0:
        lat = links.inter_latency_s if any_inter else links.intra_latency_s
    return links.fixed_s + worst + lat, total
