"""The compiled program: what every worker executes, in one global order, each step.

This is the one interpreter of an :class:`~planner.plan.ExecutionPlan`: it reads every
field of every allocation and the reallocations the plan lists, and nothing else
decides where or how a call runs. Pure (testable without processes). Every worker
walks the same op list; an op names the GPUs (world ranks) that take part and the
others skip it at once, so calls on disjoint meshes run concurrently, and
point-to-point transfers always meet their peer, because both sides reach them in the
same order. Data never passes through the controller: a ``Send`` moves a record from
a rank of the producing mesh to each rank of the consuming mesh that lacks it.

Ops, in order for each MFC of the graph:
``Realloc`` (the plan's reallocation into this call's placement, when it lists one),
``Send`` (input records to ranks lacking them), ``Call`` (the MFC itself, with its
allocation), ``RuleReward`` (the graph's reward functions on what a generate call
wrote), ``Evaluate`` (the graph's evaluations of it), then ``Release`` (free a
reallocated copy after its last use in the step). Every op carries ``every``: the ops
of an evaluation's MFC run only on evaluation steps (:meth:`Program.ops_for`).

What each allocation field becomes: ``mesh``, ``layout`` -> the replica and the ranks
of the call; ``micro_batches`` -> the call's micro-batches (generation: waves);
``engine`` -> which engine generates (realign's own or vLLM);
``mfc``, ``role``, ``kind`` -> the graph's call (the plan is checked to match it);
``mesh_name`` -> the call's label; ``time_s`` and ``mem_bytes`` -> the estimates the
run holds itself to (:meth:`Program.collective_timeout_s`,
:meth:`Program.memory_shortfall`). A reallocation's ``bytes`` are what its executor
must move (checked at run time), its ``time_s`` enters the timeout like a call's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.graph.dataflow import DataflowGraph
from planner.graph.proximal import PROXIMAL_MFC
from planner.plan import ExecutionPlan, MFCAllocation
from realign.run.ops import (
    Call,
    Evaluate,
    Op,
    Realloc,
    Release,
    Replica,
    RuleReward,
    Send,
    estimate_s,
    runs_ahead,
)

#: The shortest collective timeout (torch's default for NCCL and gloo is 10 minutes).
MIN_COLLECTIVE_TIMEOUT_S = 600.0
#: How many times its estimated serial duration a step may take before a rank waiting
#: on a peer gives up (estimates are rough; a slow step must not kill the run).
TIMEOUT_SAFETY = 10.0


@dataclass(frozen=True)
class RoundSpan:
    """DAPO's sampling rounds (:mod:`realign.worker.sampling_loop`): ``ops[start:end]``
    generate the rollout and score it; they run again, on a round's own prompts, until
    ``groups_wanted`` informative groups are kept or the rounds run out. No op of the
    span releases a copy (the rounds reuse it) and every op of it runs every step."""

    start: int
    end: int
    keys: tuple[str, ...]        #: records the span makes, kept across rounds
    rewards_key: str             #: the rewards a round is judged by ...
    decider: int                 #: ... held by this rank (the first holder)
    group_size: int              #: samples per prompt
    groups_per_round: int        #: prompts a round generates for
    groups_wanted: int           #: groups the train call trains
    role: str                    #: the trained role (its metrics' prefix)


@dataclass(frozen=True)
class Program:
    replicas: tuple[Replica, ...]
    ops: tuple[Op, ...]
    dataset_keys: tuple[str, ...]   #: graph keys the dataset fills (training batch, eval set)
    n_ranks: int
    #: asynchronous: the first ``head`` ops reallocate the weights generation runs
    #: with; ``prologue`` generates the step's own rollout when none was made ahead
    #: (the run's first step), inserted right after them (before the rollout's sends)
    head: int = 0
    prologue: tuple[Op, ...] = ()
    max_staleness: int = 0
    #: DAPO's sampling rounds (None: the rollout runs once a step)
    rounds: RoundSpan | None = None

    @property
    def asynchronous(self) -> bool:
        return any(runs_ahead(op) for op in self.ops)

    @property
    def ahead_ranks(self) -> tuple[int, ...]:
        """The ranks that hold a rollout made ahead between steps."""
        return tuple(sorted({g for op in self.ops if runs_ahead(op) for g in op.ranks}))

    @property
    def evaluates(self) -> bool:
        """The program evaluates on held-out prompts (on the evaluation steps)."""
        return any(isinstance(op, Evaluate) for op in self.ops)

    def ops_for(self, evaluate: bool, prologue: bool = False, last: bool = False
                ) -> tuple[Op, ...]:
        """The ops of a step: all of them on an evaluation step, else those that run
        every step. Asynchronous programs: ``prologue`` (no rollout was made ahead for
        this step) generates it first; on the ``last`` step nothing is made ahead."""
        ops = list(self.ops)
        if prologue:
            ops[self.head:self.head] = self.prologue
        if last:
            ops = [op for op in ops if not runs_ahead(op)]
        return tuple(op for op in ops if evaluate or op.every == 1)

    def collective_timeout_s(self) -> float:
        """How long a rank may wait on a peer: a step's estimated duration if every call
        and reallocation ran one after another (a rank can idle while other meshes run
        all of them), times :data:`TIMEOUT_SAFETY`, and never below
        :data:`MIN_COLLECTIVE_TIMEOUT_S`."""
        serial = sum(estimate_s(op) for op in self.ops)
        return max(MIN_COLLECTIVE_TIMEOUT_S, TIMEOUT_SAFETY * serial)

    def round_quantum(self) -> int:
        """The prompts a later sampling round's size is a multiple of
        (:func:`round_quantum` of the span's calls' data-parallel sizes); 1 without
        sampling rounds."""
        span = self.rounds
        if span is None:
            return 1
        dp = {r.key: r.dp for r in self.replicas}
        calls = [op for op in self.ops[span.start:span.end] if isinstance(op, Call)]
        return round_quantum([dp[op.replica] for op in calls], span.group_size)

    def memory_shortfall(self, rank: int, free_bytes: float) -> str | None:
        """Why ``rank``'s device cannot hold the plan when ``free_bytes`` are free before
        anything is built (None when it can): the planned peak of its calls."""
        mine = [op for op in self.ops if isinstance(op, Call) and rank in op.ranks]
        if not mine:
            return None
        worst = max(mine, key=lambda op: op.estimate_mem_bytes)
        if worst.estimate_mem_bytes <= free_bytes:
            return None
        gib = 2 ** 30
        return (f"GPU {rank} has {free_bytes / gib:.1f} GiB free, but the plan needs "
                f"{worst.estimate_mem_bytes / gib:.1f} GiB on it while {worst.name} runs")


def round_quantum(dps: list[int], group_size: int) -> int:
    """The fewest prompts whose groups' rows split evenly over every one of ``dps``
    (the data-parallel sizes of a round's calls). Example: dp 2 and 4, groups of 2 ->
    rows a multiple of 4 -> 2 prompts."""
    rows = math.lcm(*dps)
    return rows // math.gcd(rows, group_size)


def replica_key(role: str, first_gpu: int, n_gpus: int, tp: int, pp: int, ep: int = 1) -> str:
    return f"{role}@g{first_gpu}+{n_gpus}:tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else "")


def _key(a: MFCAllocation) -> str:
    return replica_key(a.role, a.mesh.first_gpu, a.mesh.n_gpus, a.layout.tp, a.layout.pp,
                       a.layout.ep)


def compile_program(plan: ExecutionPlan, round_group_size: int | None = None) -> Program:
    """The replicas to build and the ops of one step, from ``plan`` (consistent by
    construction: :func:`planner.plan.plan_problems`). ``round_group_size`` (DAPO's
    sampling rounds: the samples per prompt): the rollout and its scoring form the
    program's :class:`RoundSpan`, and the copies they use are released after it.

    An asynchronous plan's step (the simulator's order, :mod:`planner.search.simulator`):
    first the reallocations of the weights its rollout generation runs with, then the
    sends of the rollout the previous step made (held by the generating mesh) to every
    mesh that reads it, then the other MFCs in graph order, then the generation of the
    next step's rollout (``ahead``), which so waits for no call of the other side."""
    graph = plan.graph
    datasets = tuple(graph.dataset_keys())
    heads = {pm.role: pm.head for pm in plan.models}
    train = {a.role: a for a in plan.allocations if a.kind == "train"}
    realloc_to = {r.to_mfc: r for r in plan.reallocations}
    replicas: dict[str, Replica] = {}
    # a copy is filled by reallocations if any call on it has one (a call that runs the
    # base with its adapters off has none, and may use a copy another call fills)
    filled = {_key(a) for a in plan.allocations if a.mfc in realloc_to}
    for a in plan.allocations:
        key = _key(a)
        if key not in replicas:
            replicas[key] = Replica(
                key, a.role, heads[a.role], a.mesh.first_gpu, a.mesh.n_gpus, a.layout.tp,
                a.layout.pp, a.layout.dp,
                trained=a.role in train and a.shards == train[a.role].shards,
                reallocated=key in filled, ep=a.layout.ep)
    everyone = tuple(range(plan.cluster.n_gpus))
    holders: dict[str, tuple[int, ...]] = {k: everyone for k in datasets}
    ahead = [m for m in graph.mfcs if graph.is_ahead(m)]
    order = [m for m in graph.mfcs if not graph.is_ahead(m)] + ahead
    head: list[Op] = []
    hoisted: list[Op] = []      #: the rollout made ahead, sent on at the step's start
    groups: list[tuple[str, list[Op]]] = []      #: (replica, its MFC's ops) in order
    made_ahead: set[str] = set()
    for m in ahead:
        ranks = tuple(plan.allocation(m.name).mesh.gpus)
        for k in m.output_keys + tuple(r.out_key for r in graph.rule_reward_after(m.name)):
            holders[k] = ranks
            made_ahead.add(k)
    for m in order:
        a = plan.allocation(m.name)
        key = _key(a)
        ranks = tuple(a.mesh.gpus)
        is_ahead = graph.is_ahead(m)
        ops: list[Op] = []
        r = realloc_to.get(m.name)
        if r is not None:
            src = _key(train[m.role])
            (head if is_ahead else ops).append(
                Realloc(m.every, m.role, m.name, src, key,
                        tuple(sorted(set(replicas[src].ranks) | set(ranks))),
                        r.bytes, plan.cost_config.param_dtype_bytes, r.time_s))
        for k in m.input_keys:
            have = holders[k]
            lack = tuple(g for g in ranks if g not in have)
            if lack:
                early = k in made_ahead and not is_ahead and m.every == 1
                (hoisted if early else ops).append(
                    Send(m.every, k, have, lack, tuple(sorted(set(have[:len(lack)]) | set(lack)))))
                if m.every == 1:            # an evaluation's sends do not always run
                    holders[k] = tuple(sorted(set(have) | set(lack)))
        ops.append(Call(m.every, m, key, a.micro_batches, ranks, a.mesh_name, a.time_s,
                        a.mem_bytes, a.optimizer_offload, a.host_bytes,
                        a.activation_recompute,
                        ahead=is_ahead, sees_update=is_ahead and r is None,
                        train_state_offload=a.train_state_offload, engine=a.engine,
                        token_budget=a.token_budget))
        for k in m.output_keys:
            holders[k] = ranks
        for rule in graph.rule_reward_after(m.name):
            ops.append(RuleReward(m.every, rule.seqs_key, m.input_keys[0], rule.out_key, ranks,
                                  ahead=is_ahead))
            holders[rule.out_key] = ranks
        for ev in graph.evaluations_after(m.name):
            ops.append(Evaluate(m.every, ev.seqs_key, m.input_keys[0], ev.name, ranks))
        groups.append((key, ops))
    # free reallocated copies right after their last call of the step, and after their
    # last call of an evaluation step (a copy an evaluation uses is reallocated again)
    flat: list[Op] = list(head) + hoisted
    last_use: dict[tuple[str, int], int] = {}     #: (replica, every) -> op index
    for key, ops in groups:
        flat += ops
        if replicas[key].reallocated:
            last_use[(key, ops[-1].every)] = len(flat) - 1
    span = _round_span(graph, flat) if round_group_size is not None else None
    if span is not None:        # released after the rounds, not inside one
        last_use = {k: span[1] - 1 if span[0] <= i < span[1] else i
                    for k, i in last_use.items()}
    last: dict[int, list[str]] = {}
    for (key, _), i in last_use.items():
        last.setdefault(i, []).append(key)
    out: list[Op] = []
    where: dict[int, int] = {}          #: flat index -> out index
    for i, op in enumerate(flat):
        where[i] = len(out)
        out.append(op)
        for key in last.get(i, ()):
            out.append(Release(op.every, key, replicas[key].ranks))
    prologue = tuple(replace(op, ahead=False, sees_update=False) if isinstance(op, Call)
                     else replace(op, ahead=False)
                     for op in out
                     if isinstance(op, (Call, RuleReward)) and op.ahead)
    rounds = None
    if span is not None and round_group_size is not None:
        start, end = where[span[0]], where[span[1] - 1] + 1
        rounds = _span_of(plan, out, start, end, round_group_size)
    return Program(tuple(replicas.values()), tuple(out), datasets, plan.cluster.n_gpus,
                   head=len(head), prologue=prologue, max_staleness=graph.max_staleness,
                   rounds=rounds)


def _round_span(graph: DataflowGraph, flat: list[Op]) -> tuple[int, int]:
    """[first, last + 1) of the ops (in ``flat``) of the rollout's generate call and the
    calls that score its sequences (not the training forward's proximal pass, which
    scores the batch the rounds made), with the sends and rule rewards between them."""
    rollout = next(m for m in graph.mfcs if m.kind == "generate" and not m.is_eval)
    seqs = rollout.output_keys[0]
    names = {rollout.name} | {m.name for m in graph.mfcs if m.kind == "inference"
                              and seqs in m.input_keys and m.name != PROXIMAL_MFC}
    mine = [i for i, op in enumerate(flat) if isinstance(op, Call) and op.name in names]
    last = mine[-1]
    while last + 1 < len(flat) and isinstance(flat[last + 1], RuleReward):
        last += 1
    return mine[0], last + 1


def _span_of(plan: ExecutionPlan, ops: list[Op], start: int, end: int,
             group_size: int) -> RoundSpan:
    calls = [op for op in ops[start:end] if isinstance(op, Call)]
    rules = [op for op in ops[start:end] if isinstance(op, RuleReward)]
    keys = tuple(k for c in calls for k in c.outputs) + tuple(r.out_key for r in rules)
    holder = next((r.ranks for r in rules if r.out_key == "rewards"), None) or next(
        c.ranks for c in calls if "rewards" in c.outputs)
    train = next(m for m in plan.graph.mfcs if m.kind == "train")
    return RoundSpan(start, end, keys, "rewards", holder[0], group_size,
                     calls[0].mfc.n_seqs // group_size, train.n_seqs // group_size,
                     train.role)
