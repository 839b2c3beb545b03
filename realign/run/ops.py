"""The ops of a compiled program (:mod:`realign.run.program`), what every worker walks in
one global order: ``Realloc``, ``Send``, ``Call``, ``RuleReward``, ``Evaluate`` and
``Release``, each naming the ranks that take part, and the replicas they run on
(``Replica``); :func:`runs_ahead` and :func:`estimate_s` read any of them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from planner.graph.dataflow import MFC


@dataclass(frozen=True)
class Replica:
    """One model placement hosted by the workers of its mesh."""

    key: str               #: "<role>@g<first>+<n>:tp<tp>pp<pp>" (then "ep<ep>" above 1)
    role: str
    head: str              #: "lm" or "value"
    first_gpu: int
    n_gpus: int
    tp: int
    pp: int
    dp: int
    trained: bool          #: this is the copy the optimizer updates
    reallocated: bool      #: filled from the trained copy before each use, not loaded
    ep: int = 1            #: expert parallelism inside the dp ranks (the plan's layout.ep)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.first_gpu, self.first_gpu + self.n_gpus))


@dataclass(frozen=True)
class Realloc:
    every: int              #: runs on steps where its MFC runs (1: every step)
    role: str
    to_mfc: str             #: the call it prepares
    src: str                #: replica key (the trained copy)
    dst: str
    ranks: tuple[int, ...]  #: src ∪ dst
    bytes: int              #: what the plan says the executor moves ...
    dtype_bytes: int        #: ... at this many bytes per element
    estimate_s: float


@dataclass(frozen=True)
class Send:
    every: int
    key: str
    src_ranks: tuple[int, ...]   #: ranks holding the record
    dst_ranks: tuple[int, ...]   #: ranks that need it and lack it
    ranks: tuple[int, ...] = ()

    def sender_of(self, dst: int) -> int:
        """Spread receivers over holders: the i-th receiver gets it from holder i mod n."""
        return self.src_ranks[self.dst_ranks.index(dst) % len(self.src_ranks)]


@dataclass(frozen=True)
class Call:
    """One MFC on its replica, as its allocation says."""

    every: int
    mfc: MFC                     #: the graph's call (keys, batch shape, greedy, ...)
    replica: str
    micro_batches: int           #: micro-batches per step and replica (generation: waves)
    ranks: tuple[int, ...]
    mesh_name: str
    estimate_s: float
    estimate_mem_bytes: float    #: planned peak memory per GPU of the mesh
    optimizer_offload: bool = False     #: train: Adam state on the host (the plan's)
    estimate_host_bytes: float = 0.0    #: planned host memory per GPU (optimizer offload)
    activation_recompute: bool = False  #: train: recompute layer activations in backward
    ahead: bool = False                 #: generates the next step's rollout (asynchronous)
    #: it runs on the trained copy after this step's update (an ahead call without a
    #: reallocation of its own), so it samples with the next policy version
    sees_update: bool = False
    #: train: between calls only the weights stay on the device (the plan's)
    train_state_offload: bool = False
    #: generate: realign's own engine (waves) or vllm (the plan's)
    engine: str = "own"
    #: packed scoring: the most tokens of one bin (the plan's; ``micro_batches`` is then
    #: the expected bin count); None: the micro-batch count bounds the bins
    token_budget: int | None = None

    @property
    def name(self) -> str:
        return self.mfc.name

    @property
    def kind(self) -> str:
        return self.mfc.kind

    @property
    def role(self) -> str:
        return self.mfc.role

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.mfc.input_keys

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.mfc.output_keys


@dataclass(frozen=True)
class RuleReward:
    every: int
    seqs_key: str           #: generated sequences to score
    prompts_key: str        #: the prompts they answer (texts and reference answers)
    out_key: str            #: where the rewards go
    ranks: tuple[int, ...]
    ahead: bool = False     #: scores the next step's rollout (asynchronous)


@dataclass(frozen=True)
class Evaluate:
    every: int
    seqs_key: str           #: generated sequences to score
    prompts_key: str        #: the held-out prompts they answer
    name: str               #: metrics ``eval.<name>_...``
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Release:
    every: int
    replica: str
    ranks: tuple[int, ...]


Op = Realloc | Send | Call | RuleReward | Evaluate | Release


def runs_ahead(op: Op) -> bool:
    """Whether ``op`` works on the next step's rollout (asynchronous execution): a
    generate call or a rule reward the plan runs ahead; no other kind of op does."""
    match op:
        case Call() | RuleReward():
            return op.ahead
        case Realloc() | Send() | Evaluate() | Release():
            return False
        case _:
            assert_never(op)


def estimate_s(op: Op) -> float:
    """The plan's estimate of ``op``'s duration: a call's or a reallocation's; 0 for the
    ops the plan does not price (sends, rewards, evaluations' scoring, releases)."""
    match op:
        case Call() | Realloc():
            return op.estimate_s
        case Send() | RuleReward() | Evaluate() | Release():
            return 0.0
        case _:
            assert_never(op)
