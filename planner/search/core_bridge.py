"""The bridge to the C++ search core ``planner._core`` (built from ``csrc/``).

:func:`to_core` packs a :class:`planner.search.problem.Problem` into plain arrays once;
:func:`core_simulate` and :func:`core_anneal` then run the C++ twins of
:func:`planner.search.simulator.simulate` and :func:`planner.search.anneal.anneal`, which return
bit-identical numbers (``tests/planner/test_core_twin.py`` checks it).

The extension is imported lazily, and a missing one is an error that says how to
build it: there is no silent fallback to the (much slower) Python twin.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from planner.search.anneal import MASK64, AnnealResult, AnnealSettings
from planner.search.mesh_blocks import columns
from planner.search.problem import Problem
from planner.search.simulator import SimResult


def load_core() -> ModuleType:
    """The compiled module ``planner._core``; ImportError saying how to build it."""
    try:
        return importlib.import_module("planner._core")
    except ImportError as exc:
        raise ImportError(
            "the C++ search core planner._core is not built: run `make install` "
            "(or `make core` to rebuild it in place after editing csrc/)") from exc


def to_core(prob: Problem) -> Any:
    """Pack ``prob`` into a ``planner._core.Problem`` (validated on construction)."""
    core = load_core()
    links = prob.links
    cands = prob.cands
    if prob.mesh_blocks:
        # as priced: each allocation's fields once per mesh size, repeated per mesh
        packed = [columns(blocks) for blocks in prob.mesh_blocks]
        cols: list[Any] = [p[0] for p in packed]
        mesh_groups = [p[1] for p in packed]
        mesh_of = [p[2] for p in packed]
    else:
        cols, mesh_groups, mesh_of = _pack_candidates(prob)

    def column(k: int) -> list[list[float]]:
        return [list(col[k]) if col else [] for col in cols]

    return core.Problem(
        n_gpus=prob.n_gpus,
        mem_limit_bytes=float(prob.mem_limit_bytes),
        n_iters=prob.n_iters,
        gpus_per_node=links.gpus_per_node,
        intra_bytes_per_s=float(links.intra_bytes_per_s),
        inter_bytes_per_s=float(links.inter_bytes_per_s),
        intra_latency_s=float(links.intra_latency_s),
        inter_latency_s=float(links.inter_latency_s),
        mfc_model=list(prob.mfc_model),
        mfc_is_train=[bool(t) for t in prob.mfc_is_train],
        deps=[list(d) for d in prob.deps],
        model_train_mfc=list(prob.model_train_mfc),
        model_lora=[bool(x) for x in (prob.model_lora or [False] * len(prob.model_train_mfc))],
        mfc_base=[bool(x) for x in (prob.mfc_base or [False] * len(prob.mfc_model))],
        realloc_models=[(m.n_layers, m.layer_sharded_bytes, m.layer_replicated_bytes,
                         m.embedding_bytes, m.final_norm_bytes, m.head_kind, m.head_bytes,
                         m.layer_expert_bytes, m.dense_layer_sharded_bytes,
                         m.dense_layer_replicated_bytes, *m.dense_layers)
                        for m in prob.realloc_models],
        cand_first_gpu=column(0),
        cand_n_gpus=column(1),
        cand_tp=column(2),
        cand_pp=column(3),
        cand_dp=column(4),
        cand_ep=column(10),
        cand_time_s=column(5),
        cand_resident_bytes=column(6),
        cand_activation_bytes=column(7),
        cand_weights_bytes=column(8),
        mesh_groups=mesh_groups,
        mesh_of=mesh_of,
        realloc_fixed_s=float(links.fixed_s),
        copy_bytes_per_s=float(links.copy_bytes_per_s),
        inputs=[[list(kp) for kp in ins] for ins in prob.inputs],
        outputs=[list(o) for o in prob.outputs],
        mfc_every=list(prob.mfc_every),
        ahead=[bool(a) for a in (prob.ahead or [False] * len(cands))],
        key_send_intra_s=[float(a) for a, _ in prob.key_send_s],
        key_send_inter_s=[float(b) for _, b in prob.key_send_s],
        step_overhead_s=float(prob.step_overhead_s),
        cand_time_sd_s=column(9),
    )


def core_simulate(prob: Problem, assign: list[int], core_prob: Any = None) -> SimResult:
    """:func:`planner.search.simulator.simulate` in C++ (no events, no realloc table).

    Pass ``core_prob`` (from :func:`to_core`) to skip packing ``prob`` again.
    """
    core = load_core()
    cp = core_prob if core_prob is not None else to_core(prob)
    iter_time_s, makespan_s, overflow_bytes, peak_bytes = core.simulate(cp, list(assign))
    return SimResult(iter_time_s, makespan_s, overflow_bytes, peak_bytes)


def core_anneal(prob: Problem, start: list[int], settings: AnnealSettings,
                time_limit_s: float = 0.0, core_prob: Any = None) -> AnnealResult:
    """:func:`planner.search.anneal.anneal` in C++ (the GIL is released while it runs).

    ``time_limit_s`` > 0 stops the walk early (checked every 256 steps); the result's
    ``steps`` is the number of steps actually run.
    """
    core = load_core()
    cp = core_prob if core_prob is not None else to_core(prob)
    assign, e, feasible, steps, accepted = core.anneal(
        cp, list(start), settings.n_steps, settings.t0_frac, settings.t1_frac,
        settings.restart_every, settings.seed & MASK64, time_limit_s, settings.patience)
    return AnnealResult(list(assign), e, feasible, steps, accepted)


class CoreSimulator:
    """:func:`planner.search.simulator.simulate` and :func:`core_anneal` in C++ over one
    packed problem and one reallocation cache that lasts from call to call (the search
    prices its heuristics, its seeds and every annealing chain through it)."""

    def __init__(self, prob: Problem):
        self.prob = prob
        self.core_prob = to_core(prob)
        self._sim = load_core().Simulator(self.core_prob)

    def __call__(self, assign: list[int]) -> SimResult:
        iter_time_s, makespan_s, overflow_bytes, peak_bytes = self._sim.simulate(list(assign))
        return SimResult(iter_time_s, makespan_s, overflow_bytes, peak_bytes)

    def anneal(self, start: list[int], settings: AnnealSettings,
               time_limit_s: float = 0.0) -> AnnealResult:
        assign, e, feasible, steps, accepted = self._sim.anneal(
            list(start), settings.n_steps, settings.t0_frac, settings.t1_frac,
            settings.restart_every, settings.seed & MASK64, time_limit_s, settings.patience)
        return AnnealResult(list(assign), e, feasible, steps, accepted)


def _pack_candidates(prob: Problem) -> tuple[list[Any], list[list[list[int]]], list[list[int]]]:
    """Columns, same-mesh groups and per candidate its group's index, read from the
    candidates one by one (a problem assembled without mesh blocks: hand-written plans)."""
    cands = prob.cands
    # one pass over each MFC's candidates (there are 420,000 at 1024 GPUs), then one
    # column per field
    cols = [list(zip(*[(c.first_gpu, c.n_gpus, c.tp, c.pp, c.dp, float(c.time_s),
                        float(c.resident_bytes), float(c.activation_bytes),
                        float(c.weights_bytes), float(c.time_sd_s), c.ep) for c in cs]))
            for cs in cands]

    # each same-mesh group once, and per candidate its group's index: a group is one list
    # shared by its candidates (assemble), so packing it per candidate copied it as often
    mesh_groups: list[list[list[int]]] = []
    mesh_of: list[list[int]] = []
    for groups in prob.same_mesh:
        index: dict[int, int] = {}
        held: list[list[int]] = []
        of = []
        for g in groups:
            k = index.get(id(g))
            if k is None:
                k = index[id(g)] = len(held)
                held.append(g)
            of.append(k)
        mesh_groups.append(held)
        mesh_of.append(of)

    return cols, mesh_groups, mesh_of
