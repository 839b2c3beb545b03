"""How much a call's time varies from step to step, and what that costs an
asynchronous step.

An asynchronous step lasts the slower of its two sides *in that step*: the
generation of the next batch's rollout, and the scoring and training of this one's.
With a length distribution (:mod:`planner.graph.lengths`) both vary, each with a batch of
its own, so the expected step exceeds the slower side's expected time: E[max(G, T)]
> max(E[G], E[T]), most when the two are balanced. (A synchronous step runs them one
after the other: the expected sum is the sum of the expectations, nothing to add.)

* :func:`call_time_sd` prices the spread of one call's time through the cost model
  itself: the call priced at its usual length against the same call one standard
  deviation of that length shorter. The generation's length is its slowest wave's
  (:func:`~planner.graph.lengths.wave_token_moments`); a call that scores or trains the
  rollout runs on rows padded to the batch's longest
  (:func:`~planner.graph.padding.padded_moments`).
* :func:`expected_max` is Clark's (1961) expectation of the larger of two independent
  normal variables: the simulator's end of an asynchronous step.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from planner.graph.dataflow import MFC, DataflowGraph
from planner.graph.lengths import wave_token_moments
from planner.graph.padding import padded_moments
from planner.specs.layout import Layout
from planner.specs.lora import LoraSpec
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec

if TYPE_CHECKING:
    from planner.cost.cost_model import CostModel

SQRT2 = math.sqrt(2.0)
SQRT_2PI = math.sqrt(2.0 * math.pi)


def expected_max(m1: float, s1: float, m2: float, s2: float) -> float:
    """E[max(X, Y)] of independent X ~ N(m1, s1^2), Y ~ N(m2, s2^2) (Clark 1961):
    ``m1 Phi(a) + m2 Phi(-a) + theta phi(a)``, ``theta = sqrt(s1^2 + s2^2)``,
    ``a = (m1 - m2) / theta``; ``max(m1, m2)`` when neither varies. The C++ core
    computes it with the same operations (``csrc/simulate.cpp``).

    Example: two equal means of spread 1: the mean + 1/sqrt(pi) (0.564)."""
    theta = math.sqrt(s1 * s1 + s2 * s2)
    if theta <= 0.0:
        return max(m1, m2)
    a = (m1 - m2) / theta
    cdf = 0.5 * math.erfc(-a / SQRT2)
    pdf = math.exp(-0.5 * a * a) / SQRT_2PI
    return m1 * cdf + m2 * (1.0 - cdf) + theta * pdf


def rollout_of(graph: DataflowGraph) -> MFC | None:
    """The asynchronous graph's generation made ahead that has a length distribution
    (None: a synchronous graph, or every response runs to ``gen_len``)."""
    if graph.ahead_steps == 0:
        return None
    return next((m for m in graph.mfcs if graph.is_ahead(m) and m.kind == "generate"
                 and m.lengths is not None), None)


def call_time_sd(cost: CostModel, graph: DataflowGraph, mfc: MFC, spec: ModelSpec, head: str,
                 mesh: DeviceMesh, layout: Layout, micro_batches: int, offload: bool = False,
                 state_offload: bool = False, recompute: bool = False,
                 engine: str = "own", lora: LoraSpec | None = None,
                 token_budget: int | None = None) -> float:
    """Standard deviation, over steps, of one call of ``mfc`` (seconds): 0 outside an
    asynchronous graph whose rollout has a length distribution, and for a call that
    neither generates that rollout nor reads its sequences (a call that carries their
    length distribution: the batch padded to its longest response).

    Example: lengths always 3 of a cap of 20: every wave stops at the first check,
    every batch is padded to 3 tokens: 0."""
    rollout = rollout_of(graph)
    if rollout is None:
        return 0.0

    def time_at(tokens: int) -> float:      # generate: decoded; else the whole row
        at = ({"gen_len": tokens} if mfc.kind == "generate"
              else {"prompt_len": tokens, "gen_len": 0, "prompt_lengths": None})
        short = mfc.model_copy(update={**at, "lengths": None})
        return float(cost.mfc_cost(short, spec, head, mesh, layout, micro_batches, offload,
                                   state_offload, recompute, engine, lora,
                                   token_budget).time_s)

    if mfc.name == rollout.name:
        rows = mfc.n_seqs / layout.dp / micro_batches
        groups = math.ceil(micro_batches / min(micro_batches, layout.pp))
        mean, var = wave_token_moments(mfc, rows * layout.dp if groups <= 1 else rows)
        mean, sd = round(mean), math.sqrt(var / max(1, groups))
    elif mfc.kind in ("train", "inference") and (mfc.lengths is not None
                                                 or mfc.prompt_lengths is not None):
        mean, var = padded_moments(mfc)             # the batch padded to its longest row
        mean, sd = round(mean), math.sqrt(var)
    else:
        return 0.0
    if sd <= 0.0 or mean <= 1:
        return 0.0
    return max(0.0, time_at(mean) - time_at(max(1, round(mean - sd))))
