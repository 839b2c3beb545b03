"""Sizes of the records MFCs pass between meshes, and where each comes from, so the
simulator can price the ``Send`` ops the runtime executes (:mod:`realign.run.program`:
a record goes from its holders to each rank of a consuming mesh that lacks it).

What each record holds (:mod:`realign.worker.records`), for ``n`` sequences of ``s``
positions: generated sequences: tokens [n, s] int64, lengths and prompt lengths [n]
(3 tensors; a multi-turn call's episodes add their action mask [n, s-1] float32 and
answer starts, turns and environment rewards [n]: 7); per-token log-probs [n, s-1]
float32; critic values [n, s] float32;
rewards (a reward model's or a rule reward's) [n] float32; a train call's output: its
step number (one int64).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.graph.dataflow import DataflowGraph


@dataclass(frozen=True)
class RecordSize:
    nbytes: float
    tensors: int


def record_sizes(graph: DataflowGraph, heads: dict[str, str]) -> dict[str, RecordSize]:
    """Key -> size of the record every MFC (or rule reward) writes; ``heads``: role ->
    "lm" | "value"."""
    out: dict[str, RecordSize] = {}
    for m in graph.mfcs:
        n, s = m.n_seqs, m.seq_len
        for k_i, key in enumerate(m.output_keys):
            if m.kind == "train":
                out[key] = RecordSize(8, 1)
            elif m.kind == "generate" and m.turns is not None and k_i == 0:
                # episodes: + action mask [n, s-1] float32, answer starts, turns, rewards
                out[key] = RecordSize(n * s * 8 + 2 * n * 8 + n * (s - 1) * 4 + 3 * n * 8, 7)
            elif m.kind == "generate":
                out[key] = (RecordSize(n * s * 8 + 2 * n * 8, 3) if k_i == 0
                            else RecordSize(n * (s - 1) * 4, 1))
            elif heads[m.role] == "lm":
                out[key] = RecordSize(n * (s - 1) * 4, 1)
            elif m.role == "reward":
                out[key] = RecordSize(n * 4, 1)
            else:
                out[key] = RecordSize(n * s * 4, 1)
    gen_n = {k: m.n_seqs for m in graph.mfcs for k in m.output_keys}
    for r in graph.rule_rewards:
        out[r.out_key] = RecordSize(gen_n[r.seqs_key] * 4, 1)
    return out
