"""Pricing a multi-turn generate call (:mod:`planner.graph.turns` says what is priced):
each turn of each group as an ordinary generate call of its own shape, plus the time a
turn waits for its environment beyond what the other groups' decoding hides."""
from __future__ import annotations

import math
from typing import Callable

from planner.cost.mfc_cost import MFCCost
from planner.graph.dataflow import MFC


def multi_turn_cost(mfc: MFC, price: Callable[[MFC], MFCCost]) -> MFCCost:
    """``price``: the cost of a single-turn generate call (same mesh, layout, engine).
    Terms are summed over turns and groups (weighted by each turn's share), with
    ``env_wait`` added; memory is the largest turn's (the longest context)."""
    t = mfc.turns
    assert t is not None and mfc.kind == "generate"
    rows = math.ceil(mfc.n_seqs / t.groups)
    terms: dict[str, float] = {}
    mem = [0.0, 0.0, 0.0, 0.0, 0.0]
    for weight, context, new in t.turn_shapes(mfc.prompt_len, mfc.gen_len):
        sub = mfc.model_copy(update={"turns": None, "n_seqs": rows, "prompt_len": context,
                                     "gen_len": new, "lengths": None,
                                     "prompt_lengths": None})
        c = price(sub)
        for k, v in c.terms_s.items():
            terms[k] = terms.get(k, 0.0) + weight * t.groups * v
        hidden = (t.groups - 1) * c.time_s
        terms["env_wait"] = terms.get("env_wait", 0.0) + weight * max(0.0, t.env_s - hidden)
        mem = [max(a, b) for a, b in zip(mem, (c.weights_bytes, c.resident_bytes,
                                               c.activation_bytes, c.host_bytes,
                                               c.adapter_bytes))]
    return MFCCost(time_s=sum(terms.values()), terms_s=terms, weights_bytes=mem[0],
                   resident_bytes=mem[1], activation_bytes=mem[2], host_bytes=mem[3],
                   adapter_bytes=mem[4])
