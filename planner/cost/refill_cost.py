"""The time of a generate call on realign's own engine that refills its slots
(:mod:`realign.runtime.engines.refill`; ``MFC.refill``).

Per data-parallel rank, ``g = min(m, pp)`` slot groups of ``ceil(rows / m)`` slots (the
waves' cache) share the rank's queue. Each group runs the expected decode steps and
admitting iterations of :func:`planner.graph.refill.refill_shape` over its share of the
rows: per admitting iteration, a prefill of its share of the admitted prompts (padded
to their longest); per step, a decode pass of every slot over the keys of its oldest
slot (:func:`planner.graph.refill.oldest_age`); the caches allocated once. The groups pipeline over
the stages as waves do (:func:`planner.cost.passes.decode_iteration`); the call ends
with the slowest rank's gather.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from planner.cost.engine_terms import Work, lagged
from planner.cost.memory import wave_kv_bytes_per_seq
from planner.cost.passes import decode_iteration, messages, pipelined
from planner.graph.padding import longest_prompt
from planner.graph.refill import oldest_age, refill_shape

if TYPE_CHECKING:
    from planner.cost.cost_model import CostModel
    from planner.graph.dataflow import MFC
    from planner.specs.layout import Layout
    from planner.specs.lora import LoraSpec
    from planner.specs.mesh import DeviceMesh
    from planner.specs.model_spec import ModelSpec


def refill_terms(cm: "CostModel", mfc: "MFC", spec: "ModelSpec", head: str,
                 mesh: "DeviceMesh", layout: "Layout", m: int,
                 lora: "LoraSpec | None" = None) -> dict[str, float]:
    """Cost terms of the call (the module docs), keyed like the waves' terms."""
    r, dt = cm.rates, cm.config.param_dtype_bytes
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    tpn, dpn, ppn = cm._nodes(mesh, layout)
    n_local = max(1, mfc.n_seqs // dp)
    slots = math.ceil(n_local / m)
    g = min(m, pp, n_local)
    rows = math.ceil(n_local / g)                  # one group's share of the queue
    steps, admits = refill_shape(mfc, slots, rows, dp)
    a = rows / max(admits, 1.0)                    # prompts admitted together
    P, h = longest_prompt(mfc, a), spec.hidden
    # a step attends over its oldest slot's keys
    ctx = longest_prompt(mfc, slots) + oldest_age(mfc, slots)
    pre_c, dec_c = r.engine("prefill"), r.engine("decode")
    pre = cm.stage_works(spec, head, "prefill", a * P, P / 2, a, layout, tpn,
                         messages(r.collective_s("p2p", a * P * h * dt, 2, ppn)), lora=lora)
    dec = cm.stage_works(spec, head, "decode", slots, ctx, slots, layout, tpn,
                         messages(r.collective_s("p2p", slots * h * dt, 2, ppn)),
                         back=messages(r.collective_s("p2p", 2 * slots * 8, 2, ppn)), lora=lora)
    alloc = Work(seconds={"kv_alloc": g * r.mem_s(
        slots * wave_kv_bytes_per_seq(cm.config, spec, mfc, tp, pp))})
    n = mfc.gen_len
    call = Work(seconds={"dp_comm": r.collective_s("all_gather", mfc.n_seqs * (2 * n + 1) * 8,
                                                   dp, dpn)},
                counts={"call_s": 1.0, "collective_s": float(dp > 1)})
    ranks = layout.world
    terms = {f"prefill_{k}": v for k, v in lagged(
        Work().add(pipelined(pre, g, pre_c), admits).add(alloc), ranks).terms(pre_c).items()}
    for k, v in lagged(Work().add(decode_iteration(dec, g, dec_c), steps),
                       ranks).terms(dec_c).items():
        terms[f"decode_{k}"] = v
    for k, v in call.terms(pre_c).items():
        terms[k] = terms.get(k, 0.0) + v
    return terms
