"""Model function calls (MFCs) and the dataflow graph of one RLHF iteration.

An MFC is one call of one model: ``actor.generate``, ``ref.inference``,
``actor.train``... It names the keys it reads and writes; edges are derived from
keys (a key that no MFC produces comes from the dataset). A :class:`RuleReward` is
the one step that is not a model call: a reward function scores a generation's
sequences on the ranks that generated them (no GPU time, so the planner does not
price it; it only adds the key it writes). One builder per algorithm lives in
:mod:`planner.graph.algorithms`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.errors import PlanError
from planner.graph.lengths import GenLengths
from planner.graph.turns import Turns

if TYPE_CHECKING:
    import networkx as nx

Kind = Literal["generate", "inference", "train"]
#: what a call is for: ``step``, the training step (its rollout, scoring and training);
#: ``eval``, an evaluation on held-out prompts (its output feeds the metrics only)
Purpose = Literal["step", "eval"]


#: The largest staleness bound a graph takes (algorithm.max_staleness).
MAX_STALENESS = 64


class MFC(BaseModel):
    """One model function call and the shape of the data it processes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Unique name, e.g. 'actor.generate'.")
    role: str = Field(description="The model it calls: actor, critic, ref or reward.")
    kind: Kind = Field(description="generate | inference | train.")
    n_seqs: int = Field(gt=0, description="Sequences per iteration.")
    prompt_len: int = Field(gt=0, description="Prompt tokens per sequence.")
    gen_len: int = Field(ge=0, description="Generated (response) tokens per sequence.")
    input_keys: tuple[str, ...] = Field(description="Data keys read.")
    output_keys: tuple[str, ...] = Field(description="Data keys written.")
    n_minibatches: int = Field(1, gt=0, description="Optimizer steps per epoch (train only).")
    n_epochs: int = Field(1, gt=0, description="Passes over the batch (train only).")
    group_size: int = Field(1, gt=0, description="Consecutive sequences that must stay in "
                            "one micro-batch (2: a chosen/rejected preference pair).")
    greedy: bool = Field(False, description="generate: take the most likely token (ReMax's "
                         "baseline) instead of sampling.")
    micro_batches: int | None = Field(None, gt=0, description="Micro-batches per step and "
                                      "replica fixed by the user (train.micro_batches); "
                                      "None: the planner chooses.")
    every: int = Field(1, gt=0, description="Runs every this many steps (an evaluation); "
                       "priced at 1/every of its time per step.")
    purpose: Purpose = Field("step", description="step: part of the training step; eval: an "
                             "evaluation on held-out prompts (its output reaches the "
                             "metrics only, whatever its interval).")
    lengths: GenLengths | None = Field(None, description="generate: the distribution of a "
                                       "response's length (gen_len is its cap); inference, "
                                       "train: that of the responses it reads, whose batch "
                                       "is padded to its longest; None: every response runs "
                                       "to gen_len.")
    prompt_lengths: GenLengths | None = Field(
        None, description="generate, and the calls that read its rollout: the distribution "
        "of a prompt's length (prompt_len is its cap), read from the training data; None: "
        "every prompt is prompt_len long.")

    packed: bool = Field(False, description="inference, train: the rows run packed end to "
                         "end in bins of tokens (train.packing), priced at the expected "
                         "tokens of a bin (planner.graph.packing) instead of the longest "
                         "row's length per row.")
    refill: bool = Field(False, description="generate, on realign's own engine: a slot whose "
                         "sequence ended takes the next waiting prompt "
                         "(rollout.refill), priced by its expected decode steps "
                         "(planner.graph.refill) instead of waves that each wait for "
                         "their longest.")
    turns: Turns | None = Field(None, description="generate: multi-turn episodes with an "
                                "environment (rollout.env / rollout.tools); None: one "
                                "response per prompt.")
    sampling_rounds: float = Field(
        1.0, ge=1, description="generate, and the calls that score its rollout: the "
        "expected passes per step, in passes of n_seqs sequences (DAPO's dynamic sampling "
        "generates and scores again until the batch is full, a later round on as many "
        "sequences as the missing groups need: planner.graph.sampling_rounds); priced at "
        "that many passes, memory at one (a larger round runs in more waves and "
        "micro-batches).")
    adapters_off: bool = Field(
        False, description="inference: a call of its role's frozen base with the role's LoRA "
        "adapters off (the reference scored by the LoRA actor that shares its base: "
        "planner.graph.shared_base); it reads no trained tensor, so no reallocation "
        "precedes it and it runs wherever the base is loaded.")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def is_eval(self) -> bool:
        """An evaluation on held-out prompts (not part of the training step)."""
        return self.purpose == "eval"

    @model_validator(mode="after")
    def _check(self) -> "MFC":
        if self.kind == "train" and self.n_seqs % self.n_minibatches:
            raise PlanError(f"{self.n_seqs} sequences do not split into "
                            f"{self.n_minibatches} mini-batches", field=f"mfc {self.name}")
        per_step = self.n_seqs // (self.n_minibatches if self.kind == "train" else 1)
        if per_step % self.group_size:
            raise PlanError(f"{per_step} sequences per step do not split into groups of "
                            f"{self.group_size}", field=f"mfc {self.name}")
        if self.turns is not None and self.kind != "generate":
            raise PlanError("only a generate call has turns", field=f"mfc {self.name}")
        if self.packed and self.kind == "generate":
            raise PlanError("a generate call is not packed", field=f"mfc {self.name}")
        if self.refill and self.kind != "generate":
            raise PlanError("only a generate call refills its slots", field=f"mfc {self.name}")
        if self.sampling_rounds != 1.0 and self.kind == "train":
            raise PlanError("a train call runs once a step", field=f"mfc {self.name}")
        if self.greedy and self.kind != "generate":
            raise PlanError("only a generate call can be greedy", field=f"mfc {self.name}")
        if self.adapters_off and self.kind != "inference":
            raise PlanError("only an inference call runs a base with its adapters off",
                            field=f"mfc {self.name}")
        return self


class RuleReward(BaseModel):
    """A reward function on the generated text: scores the sequences under ``seqs_key``
    (written by a generate MFC) into ``out_key``, on the ranks that generated them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seqs_key: str = Field(description="Key of the generated sequences it scores.")
    out_key: str = Field(description="Key of the rewards it writes (one per sequence).")


class Evaluation(BaseModel):
    """Scores a generation on held-out prompts for the run's metrics, not for training:
    the verifier's accuracy, the reward function's mean and, over several samples per
    prompt, pass@k (metrics ``eval.<name>_...``), on the ranks that generated it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seqs_key: str = Field(description="Key of the generated sequences it scores.")
    name: str = Field(description="Metric name: greedy | sample.")


class DataflowGraph(BaseModel):
    """The MFCs of one iteration, in a topological order; edges come from keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: str
    mfcs: tuple[MFC, ...]
    rule_rewards: tuple[RuleReward, ...] = Field(
        (), description="Reward functions on generated text (no reward model).")
    evaluations: tuple[Evaluation, ...] = Field(
        (), description="Scorings of generations on held-out prompts (the eval section).")
    max_staleness: int = Field(0, ge=0, le=MAX_STALENESS, description="The most policy "
                               "versions a trained sample may lag (algorithm.max_staleness).")
    ahead_steps: int = Field(0, ge=0, le=1, description="Steps the rollout generation runs "
                             "ahead of training (asynchronous: 1, synchronous: 0).")

    @model_validator(mode="after")
    def _check(self) -> "DataflowGraph":
        names = [m.name for m in self.mfcs]
        if len(set(names)) != len(names):
            raise PlanError(f"duplicate MFC names in {names}", field="graph")
        producers: dict[str, str] = {}
        for m in self.mfcs:
            for k in m.output_keys:
                if k in producers:
                    raise PlanError(f"key {k!r} is produced by both {producers[k]} and "
                                    f"{m.name}", field="graph")
                producers[k] = m.name
        kinds = {m.name: m.kind for m in self.mfcs}
        for r in self.rule_rewards:
            if kinds.get(producers.get(r.seqs_key, "")) != "generate":
                raise PlanError(f"a rule reward scores {r.seqs_key!r}, which no generate "
                                "call writes", field="graph")
            if r.out_key in producers:
                raise PlanError(f"key {r.out_key!r} is produced by both "
                                f"{producers[r.out_key]} and a rule reward", field="graph")
            producers[r.out_key] = producers[r.seqs_key]
        for e in self.evaluations:
            if kinds.get(producers.get(e.seqs_key, "")) != "generate":
                raise PlanError(f"an evaluation scores {e.seqs_key!r}, which no generate "
                                "call writes", field="graph")
        if self.ahead_steps > self.max_staleness:
            raise PlanError(f"generation runs {self.ahead_steps} step(s) ahead, more than "
                            f"max_staleness {self.max_staleness} allows", field="graph")
        ahead = {m.name for m in self.mfcs if self.is_ahead(m)}
        for m in self.mfcs:
            if m.name in ahead and any(producers.get(k) for k in m.input_keys):
                raise PlanError(f"{m.name} runs ahead of training, so it may read only the "
                                "dataset", field="graph")
        edges = self.edges()
        if _has_cycle(names, edges):
            raise PlanError("the dataflow graph has a cycle", field="graph")
        order = {n: i for i, n in enumerate(names)}
        for a, b in sorted(edges, key=lambda e: order[e[0]]):      # by producer
            if order[a] > order[b]:
                raise PlanError(f"MFCs must be listed in dataflow order: {a} feeds {b}",
                                field="graph")
        return self

    def producer_of(self) -> dict[str, str]:
        """Key -> the MFC that writes it (a rule reward's key: the MFC that generated
        the sequences it scores, on whose ranks it is computed)."""
        out = {k: m.name for m in self.mfcs for k in m.output_keys}
        out.update({r.out_key: out[r.seqs_key] for r in self.rule_rewards})
        return out

    def dataset_keys(self) -> list[str]:
        """Keys read but produced by no MFC: they come from the dataset."""
        prod = self.producer_of()
        return sorted({k for m in self.mfcs for k in m.input_keys if k not in prod})

    def rule_reward_after(self, mfc: str) -> tuple[RuleReward, ...]:
        """The rule rewards that score what ``mfc`` generated."""
        prod = self.producer_of()
        return tuple(r for r in self.rule_rewards if prod[r.seqs_key] == mfc)

    def evaluations_after(self, mfc: str) -> tuple[Evaluation, ...]:
        """The evaluations that score what ``mfc`` generated."""
        prod = self.producer_of()
        return tuple(e for e in self.evaluations if prod[e.seqs_key] == mfc)

    def is_ahead(self, m: MFC) -> bool:
        """Whether ``m`` runs ahead of training: in an asynchronous graph, every rollout
        generation (a generate call of every step) makes the next step's samples while
        this step trains."""
        return self.ahead_steps > 0 and m.kind == "generate" and not m.is_eval

    def mfc(self, name: str) -> MFC:
        return next(m for m in self.mfcs if m.name == name)

    def edges(self) -> dict[tuple[str, str], list[str]]:
        """(a, b) -> the keys MFC b reads from MFC a, in the order b reads them."""
        prod = self.producer_of()
        out: dict[tuple[str, str], list[str]] = {}
        for m in self.mfcs:
            for k in m.input_keys:
                if k in prod:
                    out.setdefault((prod[k], m.name), []).append(k)
        return out

    def to_networkx(self) -> nx.DiGraph:
        """Nodes are MFC names; an edge a->b carries the keys b reads from a."""
        # imported here: a worker validates its run's graph (edges()) without networkx
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(m.name for m in self.mfcs)
        for (a, b), keys in self.edges().items():
            g.add_edge(a, b, keys=keys)
        return g

    def deps(self) -> list[list[int]]:
        """For each MFC (by index), the indices of the MFCs it reads from."""
        idx = {m.name: i for i, m in enumerate(self.mfcs)}
        edges = self.edges()
        return [sorted(idx[a] for a, b in edges if b == m.name) for m in self.mfcs]

    def roles(self) -> list[str]:
        seen: list[str] = []
        for m in self.mfcs:
            if m.role not in seen:
                seen.append(m.role)
        return seen

    def trainable_roles(self) -> set[str]:
        return {m.role for m in self.mfcs if m.kind == "train"}


def _has_cycle(nodes: list[str], edges: dict[tuple[str, str], list[str]]) -> bool:
    """Whether the directed graph of ``nodes`` and ``edges`` has a cycle (a self-loop
    counts): Kahn's order reaches every node exactly when there is none.

    Example: a->b, b->c: no cycle; a->b, b->a: a cycle."""
    indegree = dict.fromkeys(nodes, 0)
    for _, b in edges:
        indegree[b] += 1
    ready = [n for n in nodes if indegree[n] == 0]
    reached = 0
    while ready:
        n = ready.pop()
        reached += 1
        for a, b in edges:
            if a == n:
                indegree[b] -= 1
                if indegree[b] == 0:
                    ready.append(b)
    return reached < len(nodes)
