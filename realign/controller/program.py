"""The iteration program: what every worker executes, in one global order, each step.

Built purely from an :class:`~planner.plan.ExecutionPlan` (testable without
processes). Every worker walks the same op list; an op names the GPUs (world ranks)
that take part and the others skip it at once, so calls on disjoint meshes run
concurrently, and point-to-point transfers always meet their peer, because both
sides reach them in the same order. Data never passes through the controller: a
``Send`` moves a record from a rank of the producing mesh to each rank of the
consuming mesh that lacks it.

Ops, in order for each MFC of the graph:
``Realloc`` (a trained model's parameters to another placement), ``Send`` (input
records to ranks lacking them), ``Call`` (the MFC itself), ``RuleReward`` (a reward
function on generated text, when there is no reward model), then ``Release`` (free a
reallocated copy after its last use in the iteration).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.plan import ExecutionPlan


@dataclass(frozen=True)
class Replica:
    """One model placement hosted by the workers of its mesh."""

    key: str               #: "<role>@<mesh>:<layout>"
    role: str
    first_gpu: int
    n_gpus: int
    tp: int
    pp: int
    dp: int
    trained: bool          #: this is the copy the optimizer updates

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.first_gpu, self.first_gpu + self.n_gpus))


@dataclass(frozen=True)
class Realloc:
    role: str
    src: str                #: replica key (the trained copy)
    dst: str
    ranks: tuple[int, ...]  #: src ∪ dst


@dataclass(frozen=True)
class Send:
    key: str
    src_ranks: tuple[int, ...]   #: ranks holding the record
    dst_ranks: tuple[int, ...]   #: ranks that need it and lack it
    ranks: tuple[int, ...] = ()

    def sender_of(self, dst: int) -> int:
        """Spread receivers over holders: the i-th receiver gets it from holder i mod n."""
        return self.src_ranks[self.dst_ranks.index(dst) % len(self.src_ranks)]


@dataclass(frozen=True)
class Call:
    mfc: str
    kind: str
    role: str
    replica: str
    micro_batches: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class RuleReward:
    seqs_key: str           #: generated sequences to score
    out_key: str            #: where the rewards go
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Release:
    replica: str
    ranks: tuple[int, ...]


Op = Realloc | Send | Call | RuleReward | Release


@dataclass
class Program:
    replicas: list[Replica]
    ops: list[Op]
    dataset_keys: tuple[str, ...]
    n_ranks: int
    producers: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def replica(self, key: str) -> Replica:
        return next(r for r in self.replicas if r.key == key)


def replica_key(role: str, first_gpu: int, n_gpus: int, tp: int, pp: int) -> str:
    return f"{role}@g{first_gpu}+{n_gpus}:tp{tp}pp{pp}"


def build_program(plan: ExecutionPlan, rule_reward: bool) -> Program:
    """The replicas to build and the ops of one iteration, from ``plan``.

    ``rule_reward``: rewards come from a function on the generated text (no reward
    model): a ``RuleReward`` follows each generation, and training reads its output.
    """
    graph = plan.graph
    trained_roles = {m.role for m in graph.mfcs if m.kind == "train"}
    train_alloc = {a.role: a for a in plan.allocations if a.kind == "train"}
    replicas: dict[str, Replica] = {}
    call_replica: dict[str, str] = {}
    for a in plan.allocations:
        key = replica_key(a.role, a.mesh.first_gpu, a.mesh.n_gpus, a.layout.tp, a.layout.pp)
        call_replica[a.mfc] = key
        is_train_placement = (a.role in trained_roles and train_alloc[a.role].mesh == a.mesh
                              and (train_alloc[a.role].layout.tp, train_alloc[a.role].layout.pp)
                              == (a.layout.tp, a.layout.pp))
        if key not in replicas:
            replicas[key] = Replica(key, a.role, a.mesh.first_gpu, a.mesh.n_gpus, a.layout.tp,
                                    a.layout.pp, a.layout.dp, trained=is_train_placement)
        elif is_train_placement and a.kind == "train":
            replicas[key] = Replica(key, a.role, a.mesh.first_gpu, a.mesh.n_gpus, a.layout.tp,
                                    a.layout.pp, a.layout.dp, trained=True)
    everyone = tuple(range(plan.cluster.n_gpus))
    dataset = tuple(graph.dataset_keys())
    holders: dict[str, tuple[int, ...]] = {k: everyone for k in dataset}
    train_outputs = {k for m in graph.mfcs if m.kind == "train" for k in m.output_keys}
    last_use: dict[str, int] = {}
    ops: list[Op] = []
    for m in graph.mfcs:
        a = plan.allocation(m.name)
        key = call_replica[m.name]
        ranks = tuple(a.mesh.gpus)
        if m.role in trained_roles and m.kind != "train" and not replicas[key].trained:
            src = call_replica[train_alloc[m.role].mfc]
            ops.append(Realloc(m.role, src, key,
                               tuple(sorted(set(replicas[src].ranks) | set(ranks)))))
        inputs = list(m.input_keys)
        if rule_reward and m.kind == "train":
            inputs += [k for k in ("rewards", "greedy_rewards") if k in holders]
        if m.kind == "train":
            # training reads every record the algorithm's preparation may use
            inputs += [k for k in holders
                       if k not in inputs and k not in dataset and k not in train_outputs]
        for k in inputs:
            have = holders[k]
            lack = tuple(r for r in ranks if r not in have)
            if lack:
                ops.append(Send(k, have, lack, tuple(sorted(set(have[:len(lack)]) | set(lack)))))
                holders[k] = tuple(sorted(set(have) | set(lack)))
        ops.append(Call(m.name, m.kind, m.role, key, a.micro_batches, tuple(inputs),
                        m.output_keys, ranks))
        for k in m.output_keys:
            holders[k] = ranks
        if rule_reward and m.kind == "generate":
            out = "greedy_rewards" if "greedy_seqs" in m.output_keys else "rewards"
            seqs = "greedy_seqs" if "greedy_seqs" in m.output_keys else "seqs"
            ops.append(RuleReward(seqs, out, ranks))
            holders[out] = ranks
        if not replicas[key].trained:
            last_use[key] = len(ops) - 1
    # free reallocated copies right after their last call of the iteration
    out_ops: list[Op] = []
    for i, op in enumerate(ops):
        out_ops.append(op)
        for key, last in last_use.items():
            r = replicas[key]
            if last == i and r.role in trained_roles:
                out_ops.append(Release(key, r.ranks))
    return Program(list(replicas.values()), out_ops, dataset, plan.cluster.n_gpus, holders)
