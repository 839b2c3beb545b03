"""Layout: tensor x pipeline x data parallelism of one model on one mesh (and expert
parallelism inside the data-parallel ranks), and the rank arithmetic that places each
(tp, dp, pp) coordinate on a GPU.

Ranks inside a mesh follow Megatron's default order (tp fastest, then dp, then pp):
``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``. Example, tp-dp-pp 2-2-2 on 8 GPUs:
TP groups [[0,1],[2,3],[4,5],[6,7]], DP groups [[0,2],[1,3],[4,6],[5,7]],
PP groups [[0,4],[1,5],[2,6],[3,7]].
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import PlanError
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec


class Layout(BaseModel):
    """tp x pp x dp degrees; their product is the mesh size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(1, gt=0, description="Tensor-parallel degree (inside one node).")
    pp: int = Field(1, gt=0, description="Pipeline-parallel degree (divides the layers).")
    dp: int = Field(1, gt=0, description="Data-parallel degree (divides the batch).")
    ep: int = Field(1, gt=0, description="Expert-parallel degree, carved out of the "
                    "data-parallel ranks as megatron defines it (divides dp and the "
                    "experts; 1 for a model without experts).")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        ep = f"·EP{self.ep}" if self.ep > 1 else ""
        return f"TP{self.tp}·PP{self.pp}·DP{self.dp}{ep}"


class Allocation(BaseModel):
    """Where and how one MFC runs: a mesh, a layout and a micro-batch count."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mesh: DeviceMesh = Field(description="{first_gpu, n_gpus}: a power-of-two slice of a "
                             "node or whole consecutive nodes.")
    layout: Layout = Field(description="{tp, pp, dp} with tp*pp*dp = mesh GPUs.")
    micro_batches: int = Field(1, gt=0, description="Micro-batches per (mini-)batch and replica.")


def shard_placement(first_gpu: int, n_gpus: int, tp: int, pp: int,
                    ep: int = 1) -> tuple[int, int, int, int, int]:
    """What decides which GPU holds which parameter shard: the mesh, (tp, pp) and the
    experts' split ep; dp follows from them and micro-batches only split the batch. A call of a trained
    model whose shard placement differs from its training call's needs a reallocation
    (the one rule: the simulator prices it, the plan lists it, the run executes it).

    >>> shard_placement(0, 4, 2, 1) == shard_placement(0, 4, 2, 1)
    True
    """
    return (first_gpu, n_gpus, tp, pp, ep)


# ---- rank arithmetic (pure) ------------------------------------------------------

def coords_of_rank(rank: int, layout: Layout) -> tuple[int, int, int]:
    """Mesh rank -> (tp_rank, dp_rank, pp_rank). With tp-dp-pp 2-2-2, rank 5 -> (1, 0, 1)."""
    tp_rank = rank % layout.tp
    dp_rank = (rank // layout.tp) % layout.dp
    pp_rank = rank // (layout.tp * layout.dp)
    return tp_rank, dp_rank, pp_rank


def rank_of_coords(tp_rank: int, dp_rank: int, pp_rank: int, layout: Layout) -> int:
    """(tp_rank, dp_rank, pp_rank) -> mesh rank. With tp-dp-pp 2-2-2, (1, 0, 1) -> 5."""
    return tp_rank + layout.tp * (dp_rank + layout.dp * pp_rank)


def tp_groups(layout: Layout) -> list[list[int]]:
    """TP groups in mesh ranks. tp-dp-pp 2-2-2 -> [[0,1],[2,3],[4,5],[6,7]]."""
    return [[rank_of_coords(t, d, p, layout) for t in range(layout.tp)]
            for p in range(layout.pp) for d in range(layout.dp)]


def dp_groups(layout: Layout) -> list[list[int]]:
    """DP groups in mesh ranks. tp-dp-pp 2-2-2 -> [[0,2],[1,3],[4,6],[5,7]]."""
    return [[rank_of_coords(t, d, p, layout) for d in range(layout.dp)]
            for p in range(layout.pp) for t in range(layout.tp)]


def pp_groups(layout: Layout) -> list[list[int]]:
    """PP groups in mesh ranks. tp-dp-pp 2-2-2 -> [[0,4],[1,5],[2,6],[3,7]]."""
    return [[rank_of_coords(t, d, p, layout) for p in range(layout.pp)]
            for d in range(layout.dp) for t in range(layout.tp)]


def stage_layers(n_layers: int, pp: int, pp_rank: int) -> range:
    """Layers held by pipeline stage ``pp_rank`` (equal split)."""
    per = n_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def group_spans_nodes(group: list[int], mesh: DeviceMesh, gpus_per_node: int) -> bool:
    """True when a group of mesh ranks touches more than one node."""
    nodes = {(mesh.first_gpu + r) // gpus_per_node for r in group}
    return len(nodes) > 1


# ---- validity --------------------------------------------------------------------

def model_layout_problems(layout: Layout, model: ModelSpec) -> list[str]:
    """Why ``model`` cannot be split by ``layout`` (heads, FFN, vocabulary, layers).
    Shared by the planner's validity rules and the runtime's pre-flight check."""
    out = []
    if model.n_heads % layout.tp or model.n_kv_heads % layout.tp:
        out.append(f"tp={layout.tp} must divide the {model.n_heads} heads and "
                   f"{model.n_kv_heads} KV heads")
    if model.ffn_hidden % layout.tp:
        out.append(f"tp={layout.tp} must divide ffn_hidden {model.ffn_hidden}")
    if model.moe is not None and model.moe.expert_ffn_hidden % layout.tp:
        out.append(f"tp={layout.tp} must divide the experts' ffn hidden "
                   f"{model.moe.expert_ffn_hidden}")
    if model.padded_vocab % layout.tp:
        out.append(f"tp={layout.tp} must divide the padded vocabulary {model.padded_vocab}")
    if model.n_layers % layout.pp:
        out.append(f"pp={layout.pp} must divide the {model.n_layers} layers")
    out += ep_problems(model, layout.dp, layout.ep)
    return out


def ep_problems(model: ModelSpec, dp: int, ep: int) -> list[str]:
    """Why ``model`` cannot run expert-parallel at ``ep`` with ``dp`` data-parallel ranks
    (empty: it can): a model without experts, experts not divisible by ``ep``, ``ep`` not
    dividing dp. The one rule, for the planner and the runtime's pre-flight check.

    >>> from planner.specs.model_spec import model_presets
    >>> ep_problems(model_presets()["qwen3-30b-a3b"], 8, 4)
    []
    >>> ep_problems(model_presets()["qwen3-30b-a3b"], 6, 4)
    ['ep=4 must divide dp=6 (expert parallelism is carved out of the data-parallel ranks)']
    """
    if ep < 1:
        return [f"ep={ep} must be at least 1"]
    if ep == 1:
        return []
    if model.moe is None:
        return [f"ep={ep} needs a model with experts, but {model.name!r} has none "
                f"(allowed: ep 1)"]
    out = []
    if model.moe.n_experts % ep:
        out.append(f"ep={ep} must divide the {model.moe.n_experts} experts")
    if dp % ep:
        out.append(f"ep={ep} must divide dp={dp} (expert parallelism is carved out "
                   f"of the data-parallel ranks)")
    return out


def layout_problems(layout: Layout, mesh: DeviceMesh, model: ModelSpec, mfc: MFC,
                    micro_batches: int, cluster: ClusterSpec) -> list[str]:
    """Why this allocation is invalid (empty list when it is valid)."""
    out = []
    if layout.world != mesh.n_gpus:
        out.append(f"tp*pp*dp = {layout.world} but the mesh has {mesh.n_gpus} GPUs")
    if layout.tp > cluster.gpus_per_node or cluster.gpus_per_node % layout.tp:
        out.append(f"tp={layout.tp} must divide the {cluster.gpus_per_node} GPUs of a node")
    if layout.tp > mesh.n_gpus or mesh.n_gpus % layout.tp:
        out.append(f"tp={layout.tp} must divide the mesh size {mesh.n_gpus}")
    out += model_layout_problems(layout, model)
    if mfc.micro_batches is not None and micro_batches != mfc.micro_batches:
        out.append(f"micro_batches={micro_batches} but {mfc.name} runs with "
                   f"{mfc.micro_batches} (train.micro_batches)")
    per_step = mfc.n_seqs // mfc.n_minibatches if mfc.kind == "train" else mfc.n_seqs
    if per_step % layout.dp:
        out.append(f"dp={layout.dp} must divide the {per_step} sequences per step of "
                   f"{mfc.name}")
    elif (per_step // layout.dp) % mfc.group_size:
        out.append(f"dp={layout.dp} would split a group of {mfc.group_size} sequences "
                   f"(a preference pair) of {mfc.name} over two replicas")
    elif (per_step // layout.dp // mfc.group_size) % micro_batches:
        unit = "sequences" if mfc.group_size == 1 else f"groups of {mfc.group_size} sequences"
        out.append(f"micro_batches={micro_batches} must divide the "
                   f"{per_step // layout.dp // mfc.group_size} {unit} per replica of {mfc.name}")
    return out


def check_allocation(alloc: Allocation, model: ModelSpec, mfc: MFC,
                     cluster: ClusterSpec, field: str) -> None:
    """Raise a :class:`PlanError` naming ``field`` if ``alloc`` is invalid."""
    alloc.mesh.validate_on(cluster, field=f"{field}.mesh")
    probs = layout_problems(alloc.layout, alloc.mesh, model, mfc, alloc.micro_batches, cluster)
    if probs:
        raise PlanError("; ".join(probs), field=field)


def enumerate_layouts(mesh: DeviceMesh, model: ModelSpec, mfc: MFC,
                      cluster: ClusterSpec, max_ep: int | None = None) -> list[Layout]:
    """All valid (tp, pp, dp, ep) of ``model`` for ``mfc`` on ``mesh`` (micro-batches
    aside, unless the MFC fixes its count), ep ascending for each (tp, pp): ep 1 alone
    for a dense model, every ep up to ``max_ep`` (None: any) for a mixture of experts."""
    out = []
    n = mesh.n_gpus
    for tp in _divisors(n):
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            for ep in _divisors(dp) if model.moe is not None else [1]:
                if max_ep is not None and ep > max_ep:
                    break
                lay = Layout(tp=tp, pp=pp, dp=dp, ep=ep)
                if not layout_problems(lay, mesh, model, mfc, mfc.micro_batches or 1,
                                       cluster):
                    out.append(lay)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
