"""A frozen role scored as a LoRA model's base: the reference as "the actor, adapters off".

A LoRA model trains adapters on a frozen base, so while the reference policy is the
actor's own base checkpoint, the reference's log-probs are the actor's forward with its
adapters off (what PEFT's ``disable_adapter()`` gives and peers use). :func:`share_base`
rewrites such a graph: every call of the frozen role (the borrower, ``ref``) becomes a call
of the LoRA role (the owner, ``actor``) with ``adapters_off``, keeping its name, keys and
shape. The borrower then names no model of the graph, so the plan holds one base where it
held two; the simulator keeps that base once on each placement of the owner
(:mod:`planner.search.simulator`), and a call with its adapters off needs no reallocation
(it reads no trained tensor).

Which roles share is the experiment's decision (the same checkpoint, the owner has LoRA,
``lora.<owner>.share_base``: :mod:`realign.run.shared_base`); this module only rewrites.
"""
from __future__ import annotations

from planner.errors import PlanError
from planner.graph.dataflow import DataflowGraph


def share_base(graph: DataflowGraph, borrower: str, owner: str) -> DataflowGraph:
    """``graph`` with every call of ``borrower`` made a call of ``owner`` with its adapters
    off. The borrower's calls must all be scoring calls (it is frozen) and the owner must
    be called by the graph.

    PPO's ``ref.inference`` (role ``ref``) with ``share_base(g, "ref", "actor")``: the
    call ``ref.inference`` of role ``actor``, ``adapters_off``; ``g.roles()`` loses ``ref``.
    """
    roles = graph.roles()
    if owner not in roles:
        raise PlanError(f"the {borrower} cannot share the base of the {owner}: the graph "
                        f"calls no {owner} (roles {roles})", field="graph")
    mine = [m for m in graph.mfcs if m.role == borrower]
    if not mine:
        return graph
    for m in mine:
        if m.kind != "inference":
            raise PlanError(f"{m.name} is a {m.kind} call: only a frozen role's scoring can "
                            f"run on the {owner}'s base", field="graph")
    mfcs = tuple(m.model_copy(update={"role": owner, "adapters_off": True})
                 if m.role == borrower else m for m in graph.mfcs)
    return DataflowGraph.model_validate({**graph.model_dump(), "mfcs": [
        m.model_dump() for m in mfcs]})


def base_calls(graph: DataflowGraph) -> list[str]:
    """The names of the calls that run a base with its adapters off."""
    return [m.name for m in graph.mfcs if m.adapters_off]
