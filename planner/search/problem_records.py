"""The records calls pass to each other, in a search problem's numbers: which keys each
MFC reads and writes, and the seconds of one Send of each (within a node, across nodes),
which the simulator prices a call's inputs with."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from planner.graph.dataflow import DataflowGraph
from planner.graph.records import RecordSize, record_sizes

if TYPE_CHECKING:
    from planner.cost.cost_model import CostModel
    from planner.search.problem import Problem, RoleModel


def price_records(prob: Problem, graph: DataflowGraph, models: dict[str, RoleModel],
                 cost: CostModel) -> None:
    """The record bookkeeping the simulator needs to price Sends."""
    rates, dev = cost.rates, cost.cluster.device

    def send_s(size: RecordSize) -> tuple[float, float]:
        intra = rates.send_s(size.nbytes, size.tensors)
        return intra, intra + size.nbytes / rates.inter_bytes_per_s + dev.inter_node_latency_s
    add_records(prob, graph, {r: m.head for r, m in models.items()}, send_s)


def add_records(prob: Problem, graph: DataflowGraph, heads: dict[str, str],
                send_s: Callable[[RecordSize], tuple[float, float]]) -> None:
    """Fill ``prob``'s record fields: ``send_s(RecordSize) -> (within a node, across
    nodes)`` seconds of one Send."""
    sizes = record_sizes(graph, heads)
    keys = sorted(set(sizes) | set(graph.dataset_keys()))
    kid = {k: i for i, k in enumerate(keys)}
    prod = graph.producer_of()
    idx = {m.name: i for i, m in enumerate(graph.mfcs)}
    prob.inputs = [[(kid[k], idx[prod[k]] if k in prod else -1) for k in m.input_keys]
                   for m in graph.mfcs]
    prob.outputs = [[kid[k] for k in m.output_keys]
                    + [kid[r.out_key] for r in graph.rule_reward_after(m.name)]
                    for m in graph.mfcs]
    prob.mfc_every = [m.every for m in graph.mfcs]
    prob.ahead = [graph.is_ahead(m) for m in graph.mfcs]
    prob.key_names = keys
    # dataset keys: every rank holds them, they are never sent
    prob.key_send_s = [send_s(sizes[k]) if k in sizes else (0.0, 0.0) for k in keys]
