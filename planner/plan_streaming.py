"""A plan's streaming section checked against its allocations and graph
(:func:`streaming_problems`, part of :func:`planner.plan.plan_problems`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.graph.dataflow import DataflowGraph
    from planner.plan import ExecutionPlan


def greedy_rows(graph: DataflowGraph) -> int:
    """Rows a step's greedy rollout calls generate (ReMax's baseline: one a prompt),
    which a stream decodes as one more sample of each group; 0 for the others."""
    return sum(m.n_seqs for m in graph.mfcs
               if m.kind == "generate" and not m.is_eval and m.greedy)


def streaming_problems(plan: ExecutionPlan) -> list[str]:
    """Why ``plan``'s stream cannot run on its allocations (empty when it can, or has
    none): the two sides cover the cluster, the buffer holds a batch, a batch's groups
    are the sequences the actor trains and the greedy baselines (the rollout's; DAPO's
    rollout is over-sized for the constant groups it drops), the rollout's generate
    calls lie on the generation side and every other call of a step on the training
    side."""
    st = plan.streaming
    if st is None:
        return []
    if st.gen_gpus + st.train_gpus != plan.cluster.n_gpus:
        return [f"streaming: gen_gpus {st.gen_gpus} + train_gpus {st.train_gpus} is not the "
                f"cluster's {plan.cluster.n_gpus} GPUs"]
    out = []
    if st.capacity_groups < st.batch_groups:
        out.append(f"streaming: capacity_groups {st.capacity_groups} is less than a batch's "
                   f"batch_groups {st.batch_groups}")
    seqs = {m.n_seqs + greedy_rows(plan.graph) for m in plan.graph.mfcs
            if m.kind == "train" and m.role == "actor"}
    if seqs and seqs != {st.group_size * st.batch_groups}:
        out.append(f"streaming: group_size {st.group_size} x batch_groups {st.batch_groups} "
                   f"is not the {sorted(seqs)[0]} sequences the actor trains a step (with "
                   "the greedy baselines)")
    for a in plan.allocations:
        m = plan.graph.mfc(a.mfc)
        if m.is_eval:
            continue
        rollout = m.kind == "generate"
        end = a.mesh.first_gpu + a.mesh.n_gpus
        if rollout and end > st.gen_gpus:
            out.append(f"streaming: {a.mfc} runs on {a.mesh_name}, outside the generation "
                       f"side's GPUs 0..{st.gen_gpus - 1}")
        elif not rollout and a.mesh.first_gpu < st.gen_gpus:
            out.append(f"streaming: {a.mfc} runs on {a.mesh_name}, inside the generation "
                       f"side's GPUs 0..{st.gen_gpus - 1}")
    return out
