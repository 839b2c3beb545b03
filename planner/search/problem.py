"""The search problem in numbers: every candidate allocation of every MFC, with its
time and memory from the cost model, and what the simulator needs to price
reallocations. Built once per search in Python; the C++ core and its Python twin
read the same numbers, so both evaluate plans identically.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.mfc_cost import MFCBytes, MFCCost
from planner.cost.offload_terms import offload_options, state_offload_options
from planner.cost.profile import ProfileTable
from planner.cost.realloc_cost import Links, ReallocModel
from planner.cost.step_spread import call_time_sd
from planner.cost.vllm_cost import VLLM_MAX_LORA_RANK, concurrency
from planner.errors import PlanError
from planner.graph.dataflow import MFC, DataflowGraph
from planner.graph.packing import budget_options, budget_shape
from planner.search.deadline import Deadline
from planner.search.mesh_blocks import Block, mesh_groups
from planner.search.problem_records import price_records
from planner.specs.cluster import ClusterSpec
from planner.specs.layout import Layout, enumerate_layouts, shard_placement
from planner.specs.lora import LoraSpec
from planner.specs.mesh import DeviceMesh, enumerate_meshes
from planner.specs.model_spec import ModelSpec


@dataclass(frozen=True)
class RoleModel:
    """A model role of the experiment: its architecture and its head."""

    role: str
    spec: ModelSpec
    head: str          #: "lm" (actor, ref) or "value" (critic, reward)
    #: LoRA adapters on a frozen base (trained roles only)
    lora: LoraSpec | None = None


def held_bytes(c: MFCCost | MFCBytes, rm: RoleModel, mfc: MFC) -> tuple[float, float]:
    """(resident, weights) bytes of a priced call as the simulator reads them. A LoRA
    model's call other than its training keeps the frozen base where it runs (resident,
    placed once) and receives only the adapters from training (the reallocated copy);
    every other call (a call with its adapters off too: priced without them, it holds the
    base alone): the cost model's numbers."""
    if rm.lora is None or mfc.kind == "train" or mfc.adapters_off:
        return c.resident_bytes, c.weights_bytes
    return c.weights_bytes - c.adapter_bytes, c.adapter_bytes


def head_of(role: str) -> str:
    return "value" if role in ("critic", "reward") else "lm"


@dataclass(frozen=True)
class Candidate:
    """One allocation of one MFC, priced."""

    first_gpu: int
    n_gpus: int
    tp: int
    pp: int
    dp: int
    micro_batches: int
    time_s: float             #: per step: one call's time / the MFC's ``every``
    resident_bytes: float     #: train: weights+grads+optimizer; others: weights
    activation_bytes: float
    weights_bytes: float
    offload: bool = False     #: train: optimizer state in host memory (optimizer offload)
    host_bytes: float = 0.0   #: host memory per GPU it holds (offloaded state)
    state_offload: bool = False  #: train: gradients and GPU optimizer state only in the call
    #: per step: the spread of its time over steps (asynchronous graphs with a length
    #: distribution: :func:`planner.cost.step_spread.call_time_sd`; 0 otherwise)
    time_sd_s: float = 0.0
    recompute: bool = False   #: train: each layer's forward again in the backward
    engine: str = "own"       #: generate: realign's own engine (waves) or vllm
    #: packed scoring: tokens per bin (``micro_batches`` is then the expected bin count)
    token_budget: int | None = None
    ep: int = 1               #: expert-parallel degree (a mixture of experts; within dp)

    def at(self, first_gpu: int) -> "Candidate":
        """The same allocation on the mesh of its size that starts at ``first_gpu``:
        ``dataclasses.replace`` written out (copying the field dict is several times
        faster than a frozen ``__init__``; one copy per mesh and candidate)."""
        new = object.__new__(Candidate)
        fields = new.__dict__
        fields.update(self.__dict__)
        fields["first_gpu"] = first_gpu
        return new

    @property
    def place(self) -> tuple[int, int, int, int, int, int]:
        """(first_gpu, n_gpus, tp, pp, dp, ep): :data:`planner.cost.realloc_cost.Place`."""
        return (self.first_gpu, self.n_gpus, self.tp, self.pp, self.dp, self.ep)

    @property
    def shards(self) -> tuple[int, int, int, int, int]:
        """:func:`planner.specs.layout.shard_placement` of this candidate."""
        return shard_placement(self.first_gpu, self.n_gpus, self.tp, self.pp, self.ep)

    def mesh(self) -> DeviceMesh:
        return DeviceMesh(first_gpu=self.first_gpu, n_gpus=self.n_gpus)

    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep)


@dataclass
class Problem:
    cluster: ClusterSpec
    graph: DataflowGraph
    models: list[RoleModel]
    mem_limit_bytes: float
    links: Links
    mfc_model: list[int]
    mfc_is_train: list[bool]
    deps: list[list[int]]
    model_train_mfc: list[int]               #: -1 for a model that is not trained
    realloc_models: list[ReallocModel]
    cands: list[list[Candidate]]
    n_iters: int = 3
    same_mesh: list[list[list[int]]] = field(default_factory=list)
    #: per MFC: (first_gpu, n_gpus) of a mesh -> its candidates on it
    on_mesh: list[dict[tuple[int, int], list[int]]] = field(default_factory=list)
    #: records: per MFC the (key, producing MFC or -1 for the dataset) it reads, the keys
    #: it writes (a rule reward's with the MFC whose sequences it scores), its
    #: ``every``, and per key one Send's seconds (within a node, across nodes)
    inputs: list[list[tuple[int, int]]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    mfc_every: list[int] = field(default_factory=list)
    #: per MFC: it runs ahead of training (an asynchronous graph's rollout generation)
    ahead: list[bool] = field(default_factory=list)
    key_send_s: list[tuple[float, float]] = field(default_factory=list)
    key_names: list[str] = field(default_factory=list)
    #: host seconds between two steps outside every call: the controller's round trip
    #: to the workers and their batch preparation (:func:`step_overhead_s`)
    step_overhead_s: float = 0.0
    profile: ProfileTable | None = None      #: the profile the candidates were priced with
    cost_sources: dict[str, str] = field(default_factory=dict)   #: rate -> where from
    #: per model: LoRA on a frozen base. Its calls away from the training placement keep
    #: the base there (a candidate's ``resident_bytes``) and receive only the adapters
    #: (its ``weights_bytes``); empty: no model has LoRA
    model_lora: list[bool] = field(default_factory=list)
    #: per MFC: it runs its model's frozen base with the adapters off (MFC.adapters_off):
    #: no reallocation precedes it, and away from the training placement it keeps the
    #: base there like the model's other calls; empty: no such call
    mfc_base: list[bool] = field(default_factory=list)
    #: per MFC: its candidates as priced (:mod:`planner.search.mesh_blocks`); empty: a
    #: problem assembled from hand-made candidates
    mesh_blocks: list[list[Block]] = field(default_factory=list)

    @property
    def n_gpus(self) -> int:
        return self.cluster.n_gpus

    def space_size(self) -> int:
        n = 1
        for c in self.cands:
            n *= len(c)
        return n


def _micro_batch_options(per_replica: int, cap: int, fixed: int | None = None) -> list[int]:
    """Micro-batch counts to price: powers of two and the whole count that divide the
    replica's share, up to ``cap``; only ``fixed`` when the MFC fixes it."""
    if fixed is not None:
        return [fixed] if per_replica % fixed == 0 else []
    return [m for m in range(1, min(per_replica, cap) + 1) if per_replica % m == 0
            and (m & (m - 1) == 0 or m == per_replica)]


def _batching_options(mfc: MFC, per_replica: int, cap: int) -> list[tuple[int, int | None]]:
    """(micro-batches, token budget) pairs to price for ``mfc`` with ``per_replica``
    groups of rows per data-parallel rank (a training call: per optimizer step): a
    packed scoring or training call whose micro-batches are not fixed chooses a token
    budget (:func:`planner.graph.packing.budget_options`; its micro-batches are the
    expected bins, rounded up); every other call a micro-batch count
    (:func:`_micro_batch_options`) and no budget.

    Example: an unpacked call with 8 rows per replica, cap 64: [(1, None), (2, None),
    (4, None), (8, None)]."""
    if mfc.kind in ("inference", "train") and mfc.packed and mfc.micro_batches is None:
        rows = per_replica * mfc.group_size
        return [(budget_shape(mfc, rows, b)[0], b) for b in budget_options(mfc, rows, cap)]
    return [(m, None) for m in _micro_batch_options(per_replica, cap, mfc.micro_batches)]


def _pareto(cands: list[Candidate]) -> list[Candidate]:
    """Drop candidates of one placement beaten in time and memory by another (ties
    broken by the fewer micro-batches, then the smaller token budget)."""
    keep = []
    for a in cands:
        dominated = any(
            b is not a and b.time_s <= a.time_s and b.activation_bytes <= a.activation_bytes
            and b.resident_bytes <= a.resident_bytes
            and (b.time_s, b.activation_bytes, b.micro_batches, b.token_budget or 0)
            < (a.time_s, a.activation_bytes, a.micro_batches, a.token_budget or 0)
            for b in cands)
        if not dominated:
            keep.append(a)
    return keep


def build_problem(graph: DataflowGraph, models: dict[str, RoleModel], cost: CostModel,
                  n_iters: int = 3, meshes: list[DeviceMesh] | None = None,
                  deadline: Deadline | None = None, split: int | None = None) -> Problem:
    """Enumerate and price every allocation of every MFC of ``graph``.

    Candidates whose own memory already exceeds the limit are dropped (they can be
    in no feasible plan; their memory is priced first, :meth:`CostModel.mfc_bytes`, and
    their time never), and for one placement only micro-batch counts on the
    time/memory Pareto front are kept (a dominated one is never better). ``deadline``:
    a :class:`PlanError` once it has passed. ``split`` (asynchronous graphs): the
    MFCs that run ahead use GPUs below it, the other MFCs of every step the rest, so
    generation overlaps training (:func:`async_splits`).
    """
    cluster = cost.cluster
    roles = [r for r in graph.roles()]
    ridx = {r: i for i, r in enumerate(roles)}
    limit = cost.mem_limit_bytes
    meshes = meshes if meshes is not None else enumerate_meshes(cluster)
    # offloaded optimizer state: each trained model may use an equal share of a GPU's
    # part of its node's host memory, so any combination of choices fits there
    n_trained = max(1, sum(1 for m in graph.mfcs if m.kind == "train"))
    host_limit = (cluster.device.host_mem_bytes * cost.config.mem_usable_fraction / n_trained)
    train_mfc = [-1] * len(roles)
    for i, m in enumerate(graph.mfcs):
        if m.kind == "train":
            train_mfc[ridx[m.role]] = i
    # A mesh's cost depends on its size only (meshes are aligned, so node spans do
    # not depend on the position): price each (size, layout, micro-batches) once.
    by_size: dict[int, list[DeviceMesh]] = {}
    for mesh in meshes:
        by_size.setdefault(mesh.n_gpus, []).append(mesh)
    cands: list[list[Candidate]] = []
    blocks: list[list[Block]] = []
    for mfc in graph.mfcs:
        allowed = (None if split is None or mfc.is_eval else
                   (lambda m: m.first_gpu + m.n_gpus <= split) if graph.is_ahead(mfc) else
                   (lambda m: m.first_gpu >= split))
        rm = models[mfc.role]
        lora = None if mfc.adapters_off else rm.lora     # the base alone: no adapter GEMMs
        trained = train_mfc[ridx[mfc.role]] >= 0
        per_step = mfc.n_seqs // (mfc.n_minibatches if mfc.kind == "train" else 1)
        host = host_s(graph, mfc, cost.config)
        per_mfc: list[Candidate] = []
        mfc_blocks: list[Block] = []
        host_bound = False      # a candidate fit on the GPU but its offload not on the host
        batching: dict[int, list[tuple[int, int | None]]] = {}   # per dp (ep shares them)
        for size, group_meshes in by_size.items():
            if deadline is not None:
                deadline.check(f"pricing the allocations of {mfc.name} on {cluster.describe()}")
            proto = group_meshes[0]
            priced: list[Candidate] = []
            for lay in enumerate_layouts(proto, rm.spec, mfc, cluster, cost.config.max_ep):
                group = []
                if lay.dp not in batching:
                    batching[lay.dp] = _batching_options(
                        mfc, per_step // lay.dp // mfc.group_size, cost.config.max_micro_batches)
                options = batching[lay.dp]
                if mfc.kind == "train" and lay.ep > 1 and any(b for _, b in options):
                    # a token budget's bin count is each data-parallel rank's own, but the
                    # ranks of an EP group exchange tokens in every micro-batch of a train
                    # step: a fixed micro-batch count instead (the runtime refuses a budget)
                    options = [(m, None) for m in _micro_batch_options(
                        per_step // lay.dp // mfc.group_size, cost.config.max_micro_batches,
                        mfc.micro_batches)]
                for mb, budget in options:
                    for off, state_off, rc, eng in product(
                            offload_options(cost.config, cost.cluster.device, mfc),
                            state_offload_options(cost.config, cost.cluster.device, mfc),
                            cost.recompute_options(mfc), cost.engine_options(mfc, lay, mb)):
                        if eng == "vllm" and concurrency(cost, rm.spec, mfc) < 1:
                            continue        # its KV cache holds no whole sequence
                        if (eng == "vllm" and rm.lora is not None
                                and rm.lora.rank > VLLM_MAX_LORA_RANK):
                            continue        # beyond vLLM's LoRA ranks
                        # memory first: the time of what does not fit is never priced
                        b = cost.mfc_bytes(mfc, rm.spec, rm.head, proto, lay, mb, off,
                                           state_off, rc, eng, lora, budget)
                        resident, weights = held_bytes(b, rm, mfc)
                        own = b.activation_bytes + (
                            resident if (mfc.kind == "train" or not trained
                                         or rm.lora is not None) else 0.0)
                        if own <= limit and b.host_bytes > host_limit:
                            host_bound = True
                        if own > limit or b.host_bytes > host_limit:
                            continue
                        c = b if isinstance(b, MFCCost) else cost.mfc_cost(
                            mfc, rm.spec, rm.head, proto, lay, mb, off, state_off, rc, eng,
                            lora, budget, b)
                        sd = call_time_sd(cost, graph, mfc, rm.spec, rm.head, proto, lay, mb,
                                          off, state_off, rc, eng, lora, budget)
                        group.append(Candidate(0, size, lay.tp, lay.pp, lay.dp, mb,
                                               (c.time_s + host) / mfc.every, resident,
                                               c.activation_bytes, weights, off,
                                               c.host_bytes, state_off, sd / mfc.every, rc,
                                               eng, budget, lay.ep))
                priced += _pareto(group)
            firsts = [m.first_gpu for m in group_meshes if allowed is None or allowed(m)]
            for first in firsts:
                per_mfc += [c.at(first) for c in priced]
            mfc_blocks.append((priced, firsts))
        if not per_mfc and mfc.kind == "generate" and cost.config.generate_engine == "vllm":
            raise PlanError(f"{mfc.name} ({rm.spec.name}, {mfc.n_seqs} sequences of "
                            f"{mfc.seq_len} tokens per step) fits on no mesh of the cluster "
                            f"{cluster.describe()} within {limit / 2**30:.1f} GiB per GPU on "
                            "vLLM (one engine per GPU: TP 1, PP 1, with its own weights and "
                            "KV cache); set rollout.engine to own or auto",
                            field="rollout.engine")
        if not per_mfc:
            raise PlanError(f"{mfc.name} ({rm.spec.name}, {mfc.n_seqs} sequences of "
                            f"{mfc.seq_len} tokens per step) fits on no mesh of the cluster "
                            f"{cluster.describe()} within {limit / 2**30:.1f} GiB per GPU"
                            + (f" (with its training state offloaded it would fit on the "
                               f"GPUs, but not in the {host_limit / 2**30:.1f} GiB of host "
                               f"memory per GPU each trained model may use: "
                               f"cluster.device host_mem_bytes)" if host_bound else ""),
                            field="cluster")
        cands.append(per_mfc)
        blocks.append(mfc_blocks)
    return assemble(graph, models, cost, cands, n_iters, blocks)


def host_s(graph: DataflowGraph, mfc: MFC, config: CostModelConfig) -> float:
    """Host seconds after one call of ``mfc`` on every rank of its mesh: the rule
    rewards that score all the sequences it generated (``reward_s_per_seq`` each).

    Example: 64 sequences, one rule reward, 8e-6 s per sequence: 5.12e-4 s."""
    rules = len(graph.rule_reward_after(mfc.name)) if mfc.kind == "generate" else 0
    return rules * mfc.n_seqs * (config.reward_s_per_seq or 0.0)


def step_overhead_s(graph: DataflowGraph, cost: CostModel) -> float:
    """Host seconds of one step outside its calls, on the critical path: realign's own
    (the profile's :class:`~planner.cost.profile.StepCosts` for every GPU's worker) plus the
    batch every worker prepares (two in an asynchronous step: its own and the next
    one's).

    Example: 9e-4 s of realign's on 2 workers, 3e-4 s per batch, asynchronous: 1.5e-3 s."""
    step = cost.profile.step if cost.profile is not None else None
    own = step.time_s(cost.cluster.n_gpus) if step is not None else 0.0
    return own + (cost.config.batch_s or 0.0) * (1 + graph.ahead_steps)


def async_splits(cluster: ClusterSpec) -> list[int]:
    """Where an asynchronous plan may divide the cluster: generation on the GPUs below
    the split (a mesh from GPU 0), the training side on the rest."""
    return sorted({m.n_gpus for m in enumerate_meshes(cluster)
                   if m.first_gpu == 0 and m.n_gpus < cluster.n_gpus})


def assemble(graph: DataflowGraph, models: dict[str, RoleModel], cost: CostModel,
             cands: list[list[Candidate]], n_iters: int = 3,
             blocks: list[list[Block]] | None = None) -> Problem:
    """A :class:`Problem` from priced candidates: model and dependency bookkeeping,
    links and the same-mesh groups (shared by searched and hand-written plans);
    ``blocks``: the candidates as priced (:mod:`planner.search.mesh_blocks`)."""
    roles = graph.roles()
    ridx = {r: i for i, r in enumerate(roles)}
    train_mfc = [-1] * len(roles)
    for i, m in enumerate(graph.mfcs):
        if m.kind == "train":
            train_mfc[ridx[m.role]] = i
    cluster, dev, rates = cost.cluster, cost.cluster.device, cost.rates
    measured = rates.realloc_costs()
    links = Links(cluster.gpus_per_node,
                  measured.bytes_per_s if measured else rates.intra_bytes_per_s,
                  rates.inter_bytes_per_s, dev.intra_node_latency_s, dev.inter_node_latency_s,
                  fixed_s=(measured.fixed_s if measured
                           else dev.call_overhead_s + 2 * dev.intra_node_latency_s),
                  copy_bytes_per_s=rates.mem_bytes_per_s)
    prob = Problem(
        cluster=cluster, graph=graph, models=[models[r] for r in roles],
        mem_limit_bytes=cost.mem_limit_bytes, links=links,
        mfc_model=[ridx[m.role] for m in graph.mfcs],
        mfc_is_train=[m.kind == "train" for m in graph.mfcs],
        deps=graph.deps(), model_train_mfc=train_mfc,
        realloc_models=[ReallocModel.of(models[r].spec, models[r].head,
                                        cost.config.param_dtype_bytes, models[r].lora)
                        for r in roles],
        model_lora=[models[r].lora is not None for r in roles],
        mfc_base=[m.adapters_off for m in graph.mfcs],
        cands=cands, n_iters=n_iters, mesh_blocks=blocks or [], step_overhead_s=step_overhead_s(graph, cost),
        profile=cost.profile,
        cost_sources=dict(cost.rates.sources))
    price_records(prob, graph, models, cost)
    if blocks:
        for b in blocks:
            same, on = mesh_groups(b)
            prob.same_mesh.append(same)
            prob.on_mesh.append(on)
        return prob
    for cs in cands:
        groups: dict[tuple[int, int], list[int]] = {}
        for j, c in enumerate(cs):
            groups.setdefault((c.first_gpu, c.n_gpus), []).append(j)
        prob.same_mesh.append([groups[(c.first_gpu, c.n_gpus)] for c in cs])
        prob.on_mesh.append(groups)
    return prob
