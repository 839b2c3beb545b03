"""How the passes of one micro-batch through the stages compose into a call: a
micro-batch's tokens and attention context, pipelines of micro-batches, decode steps
of a group of waves, point-to-point messages between stages."""
from __future__ import annotations

from planner.cost.engine_terms import Work
from planner.cost.profile import EngineCosts
from planner.graph.dataflow import MFC
from planner.graph.packing import packed_shape
from planner.graph.padding import padded_len


def micro_batch_tokens(mfc: MFC, rows: float, m: int, dp: int) -> tuple[float, float]:
    """(tokens, mean attention context per token) of one micro-batch of ``rows`` rows of
    a scoring or training call: packed (``mfc.packed``), a bin of the expected packed
    tokens (:func:`planner.graph.packing.packed_shape`); padded, ``rows`` rows of the
    batch's expected longest (:func:`planner.graph.padding.padded_len`), half of it as
    context."""
    if mfc.packed:
        return packed_shape(mfc, rows, m, dp)
    s = padded_len(mfc)
    return rows * s, s / 2


#: A Work's priced seconds and counts by term, sorted: equal Works, equal keys.
WorkKey = tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float], ...]]


def work_key(w: Work) -> WorkKey:
    """A Work's contents as a hashable value."""
    return tuple(sorted(w.seconds.items())), tuple(sorted(w.counts.items()))


def messages(seconds: float, n: int = 1) -> Work:
    """``n`` point-to-point messages of ``seconds`` each."""
    return Work(seconds={"pp_comm": n * seconds}, counts={"collective_s": float(n)})


def pipelined(stages: list[tuple[Work, int]], m: float, costs: EngineCosts) -> Work:
    """``m`` micro-batches through the pipeline: the first crosses every stage, each
    further one adds the slowest stage's time (it paces the pipeline)."""
    out = Work()
    for w, k in stages:
        out.add(w, k)
    slowest = max((w for w, _ in stages), key=lambda w: w.total(costs))
    return out.add(slowest, m - 1)


def decode_iteration(stages: list[tuple[Work, int]], g: int, costs: EngineCosts) -> Work:
    """One decode step of a group of ``g`` waves: a wave's token crosses every stage
    before its next step starts, and each stage serves all ``g`` waves in turn, so the
    step takes the longer of one crossing and ``g`` passes of the slowest stage."""
    crossing = Work()
    for w, k in stages:
        crossing.add(w, k)
    slowest = max((w for w, _ in stages), key=lambda w: w.total(costs))
    return crossing if crossing.total(costs) >= g * slowest.total(costs) else Work().add(slowest, g)
