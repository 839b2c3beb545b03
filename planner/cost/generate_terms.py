"""The time of a generate call on realign's own engine, in its two schedules: static
waves (:mod:`realign.runtime.engines.waves`) and slots that refill
(:mod:`realign.runtime.engines.refill`; ``MFC.refill``). Both price a prefill pass and
a decode pass per stage (:meth:`planner.cost.cost_model.CostModel.stage_works`), the KV
caches' allocation and the final gather over DP; they differ in how many of each.

* Waves: ``g = min(m, pp)`` waves in flight, ``ceil(m / g)`` groups one after another.
  A group: its waves' caches zeroed, ``(g + pp - 1)`` prefill slots, then per decode
  step ``pp`` slots (a wave passes every stage; ``g <= pp`` waves share them). Decode
  steps: the expected length of a wave's longest sequence minus one (the prefill yields
  the first token), from the generation-length distribution
  (:mod:`planner.graph.lengths`).
* Refill: ``g`` slot groups of ``ceil(rows / m)`` slots (the waves' cache) share the
  rank's queue. Each group runs the expected decode steps and admitting iterations of
  :func:`planner.graph.refill.refill_shape` over its share of the rows: per admitting
  iteration, a prefill of its share of the admitted prompts (padded to their longest);
  per step, a decode pass of every slot over the keys of its oldest slot
  (:func:`planner.graph.refill.oldest_age`); the caches allocated once.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from planner.cost.engine_terms import Work, lagged
from planner.cost.memory import wave_kv_bytes_per_seq
from planner.cost.passes import decode_iteration, messages, pipelined
from planner.graph.lengths import expected_call_tokens
from planner.graph.padding import longest_prompt
from planner.graph.refill import oldest_age, refill_shape

if TYPE_CHECKING:
    from planner.cost.cost_model import CostModel
    from planner.graph.dataflow import MFC
    from planner.specs.layout import Layout
    from planner.specs.lora import LoraSpec
    from planner.specs.mesh import DeviceMesh
    from planner.specs.model_spec import ModelSpec


def wave_terms(cm: "CostModel", mfc: "MFC", spec: "ModelSpec", head: str,
               mesh: "DeviceMesh", layout: "Layout", m: int,
               lora: "LoraSpec | None" = None) -> dict[str, float]:
    """Cost terms of a generate call in ``m`` waves per rank (the module docs)."""
    pp, dp = layout.pp, layout.dp
    b = mfc.n_seqs / dp / m                # sequences per wave
    g = min(m, pp)                         # waves in flight together
    groups = math.ceil(m / g)              # groups of waves, one after another
    P = longest_prompt(mfc, b)             # a wave's prompts padded to its longest
    tokens = expected_call_tokens(mfc, b, groups, dp)   # the slowest DP rank's
    steps = max(0.0, tokens - 1.0)         # the prefill yields the first token
    pre, dec = _passes(cm, spec, head, mesh, layout, b, P, b, P + tokens / 2, lora)
    pre_c = cm.rates.engine("prefill")
    prefill = Work().add(pipelined(pre, g, pre_c).add(_kv_alloc(cm, spec, mfc, layout, g, b)),
                         groups)
    return _terms(cm, mfc, mesh, layout, prefill, dec, g, groups * steps)


def refill_terms(cm: "CostModel", mfc: "MFC", spec: "ModelSpec", head: str,
                 mesh: "DeviceMesh", layout: "Layout", m: int,
                 lora: "LoraSpec | None" = None) -> dict[str, float]:
    """Cost terms of a generate call whose ``m`` waves' cache is slots that refill (the
    module docs)."""
    dp = layout.dp
    n_local = max(1, mfc.n_seqs // dp)
    slots = math.ceil(n_local / m)
    g = min(m, layout.pp, n_local)
    rows = math.ceil(n_local / g)                  # one group's share of the queue
    steps, admits = refill_shape(mfc, slots, rows, dp)
    a = rows / max(admits, 1.0)                    # prompts admitted together
    P = longest_prompt(mfc, a)
    # a step attends over its oldest slot's keys
    ctx = longest_prompt(mfc, slots) + oldest_age(mfc, slots)
    pre, dec = _passes(cm, spec, head, mesh, layout, a, P, slots, ctx, lora)
    pre_c = cm.rates.engine("prefill")
    prefill = Work().add(pipelined(pre, g, pre_c), admits).add(
        _kv_alloc(cm, spec, mfc, layout, g, slots))
    return _terms(cm, mfc, mesh, layout, prefill, dec, g, steps)


def _passes(cm: "CostModel", spec: "ModelSpec", head: str, mesh: "DeviceMesh",
            layout: "Layout", pre_rows: float, P: float, dec_rows: float, ctx: float,
            lora: "LoraSpec | None") -> tuple[list[tuple[Work, int]], list[tuple[Work, int]]]:
    """Per-stage work of a prefill of ``pre_rows`` prompts of ``P`` tokens and of a
    decode step of ``dec_rows`` rows over ``ctx`` keys: each with its hidden states to
    the next stage, the step with the chosen tokens back."""
    r, dt, h = cm.rates, cm.config.param_dtype_bytes, spec.hidden
    tpn, _, ppn = cm.nodes_spanned(mesh, layout)
    epn = cm.ep_nodes(mesh, layout)
    pre = cm.stage_works(spec, head, "prefill", pre_rows * P, P / 2, pre_rows, layout, tpn,
                         messages(r.collective_s("p2p", pre_rows * P * h * dt, 2, ppn)),
                         lora=lora, ep_nodes=epn)
    dec = cm.stage_works(spec, head, "decode", dec_rows, ctx, dec_rows, layout, tpn,
                         messages(r.collective_s("p2p", dec_rows * h * dt, 2, ppn)),
                         back=messages(r.collective_s("p2p", 2 * dec_rows * 8, 2, ppn)),
                         lora=lora, ep_nodes=epn)
    return pre, dec


def _kv_alloc(cm: "CostModel", spec: "ModelSpec", mfc: "MFC", layout: "Layout", g: int,
              rows: float) -> Work:
    """Zeroing the KV caches of ``g`` waves or slot groups of ``rows`` rows."""
    per_seq = wave_kv_bytes_per_seq(cm.config, spec, mfc, layout.tp, layout.pp)
    return Work(seconds={"kv_alloc": g * cm.rates.mem_s(rows * per_seq)})


def _terms(cm: "CostModel", mfc: "MFC", mesh: "DeviceMesh", layout: "Layout",
           prefill: Work, dec: list[tuple[Work, int]], g: int, steps: float
           ) -> dict[str, float]:
    """The call's terms: ``prefill`` (its passes and cache allocations), ``steps`` decode
    iterations of ``g`` waves or groups, then the output gathered over DP."""
    r = cm.rates
    dp = layout.dp
    _, dpn, _ = cm.nodes_spanned(mesh, layout)
    pre_c, dec_c = r.engine("prefill"), r.engine("decode")
    n = mfc.gen_len
    call = Work(seconds={"dp_comm": r.collective_s("all_gather", mfc.n_seqs * (2 * n + 1) * 8,
                                                   dp, dpn)},
                counts={"call_s": 1.0, "collective_s": float(dp > 1)})
    ranks = layout.world
    terms = {f"prefill_{k}": v for k, v in lagged(prefill, ranks).terms(pre_c).items()}
    for k, v in lagged(Work().add(decode_iteration(dec, g, dec_c), steps),
                       ranks).terms(dec_c).items():
        terms[f"decode_{k}"] = v
    for k, v in call.terms(pre_c).items():
        terms[k] = terms.get(k, 0.0) + v
    return terms
