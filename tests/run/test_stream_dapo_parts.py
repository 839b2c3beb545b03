"""A DAPO stream's training side (:func:`realign.run.stream_parts.stream_parts`): DAPO's
plan sizes the calls scoring the rollout for its over-generated rows (12 prompts'
groups, 48 rows, for the 6 a step trains at a share of 0.5), but the stream drops the
constant groups at the buffer and sends the training side the kept batch (24 rows).
Its program's scoring calls run on those rows, at the micro-batch count the streaming
search prices them with (:func:`planner.search.stream_search.priced_on`: the plan's,
at most one a row of a data-parallel rank) where it splits them, and the batch passes
the engines' split check (:func:`realign.runtime.engines.base.check_batch`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from planner.graph.algorithms import BatchShape, build_graph
from planner.search.manual import manual_plan
from planner.search.problem import RoleModel, head_of
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Allocation, Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets
from realign.errors import UserError
from realign.run.ops import Call
from realign.run.program import compile_program
from realign.run.stream_parts import stream_parts
from realign.runtime.engines.base import check_batch

pytestmark = pytest.mark.torch

CPU4 = ClusterSpec(n_nodes=1, gpus_per_node=4, device=resolve_device("cpu"))
ROLES = ("actor", "ref")
SCORING = ("ref.inference", "actor.prox_inference")


def alloc(first: int, n: int, micro_batches: int = 1) -> Allocation:
    return Allocation(mesh=DeviceMesh(first_gpu=first, n_gpus=n),
                      layout=Layout(tp=1, pp=1, dp=n), micro_batches=micro_batches)


def dapo_parts(scoring_mb: int, frac: float = 0.5):
    """The stream's parts of a DAPO plan: the rollout on GPU 0, the rest at dp 2 on
    GPUs 2-3, the scoring calls in ``scoring_mb`` micro-batches."""
    shape = BatchShape(prompts_per_step=6, samples_per_prompt=4, prompt_len=8, gen_len=8,
                       ppo_minibatches=1, dropped_group_frac=frac)
    graph = build_graph("dapo", shape, set(ROLES), max_staleness=1, asynchronous=True)
    tiny = model_presets()["tiny-llama"]
    models = {r: RoleModel(r, tiny, head_of(r)) for r in ROLES}
    plan = manual_plan("t", graph, models, CPU4, {
        "actor.generate": alloc(0, 1), "actor.train": alloc(2, 2),
        **{name: alloc(2, 2, scoring_mb) for name in SCORING}})
    return graph, stream_parts(compile_program(plan))


def kept_batch(rows: int) -> dict[str, torch.Tensor]:
    return {"tokens": torch.ones(rows, 16, dtype=torch.long),
            "lengths": torch.full((rows,), 16)}


def shard(dp: int):
    """What check_batch reads of a replica's shard."""
    return SimpleNamespace(groups=SimpleNamespace(layout=SimpleNamespace(dp=dp)),
                           spec=SimpleNamespace(max_seq_len=64, vocab_size=128))


def scoring_calls(parts) -> dict[str, Call]:
    return {op.name: op for op in parts.train.ops
            if isinstance(op, Call) and op.name in SCORING}


def test_the_scoring_calls_run_on_the_kept_rows_in_micro_batches_that_split_them():
    """8 micro-batches at dp 2 split the plan's 48 rows (24 a rank) but not the 24 kept
    (12 a rank); 8 is what the search prices on them (at most 12 a rank): planned as
    is, the first batch the stream sends would be refused mid-run."""
    graph, parts = dapo_parts(8)
    assert {m.name: m.n_seqs for m in graph.mfcs} == {
        "actor.generate": 48, "ref.inference": 48, "actor.prox_inference": 48,
        "actor.train": 24}
    calls = scoring_calls(parts)
    assert set(calls) == set(SCORING)
    for op in calls.values():
        assert op.mfc.n_seqs == 24
        check_batch(kept_batch(op.mfc.n_seqs), shard(2), op.micro_batches)
        # the priced count where it splits the rank's 12 rows; else the next that does
        assert op.micro_batches == 12
    with pytest.raises(UserError, match="do not split"):
        check_batch(kept_batch(24), shard(2), 8)


@pytest.mark.parametrize("mb", [1, 2, 4])
def test_a_count_that_splits_the_kept_rows_is_the_plans(mb):
    _, parts = dapo_parts(mb)
    for op in scoring_calls(parts).values():
        assert (op.mfc.n_seqs, op.micro_batches) == (24, mb)
        check_batch(kept_batch(24), shard(2), op.micro_batches)


def test_a_plan_without_over_generation_keeps_its_calls():
    """No share dropped: the plan's scoring calls are the kept batch's already."""
    graph, parts = dapo_parts(4, frac=0.0)
    assert {m.n_seqs for m in graph.mfcs} == {24}
    for op in scoring_calls(parts).values():
        assert (op.mfc, op.micro_batches) == (graph.mfc(op.name), 4)


def test_data_parallel_ranks_that_cannot_split_the_kept_batch_are_refused():
    """3 prompts' groups of 2 trained, 6 generated (12 rows, 3 a rank at dp 4): the
    kept 6 rows do not split over the reference's 4 ranks, refused naming its layout."""
    shape = BatchShape(prompts_per_step=3, samples_per_prompt=2, prompt_len=8, gen_len=8,
                       ppo_minibatches=1, dropped_group_frac=0.5)
    graph = build_graph("dapo", shape, set(ROLES), max_staleness=1, asynchronous=True)
    tiny = model_presets()["tiny-llama"]
    models = {r: RoleModel(r, tiny, head_of(r)) for r in ROLES}
    cpu8 = ClusterSpec(n_nodes=1, gpus_per_node=8, device=resolve_device("cpu"))
    plan = manual_plan("t", graph, models, cpu8, {
        "actor.generate": alloc(0, 1), "actor.train": alloc(2, 2),
        "actor.prox_inference": alloc(2, 2), "ref.inference": alloc(4, 4)})
    with pytest.raises(UserError) as e:
        stream_parts(compile_program(plan))
    assert e.value.field == "plan.manual.ref.inference.layout"
    assert "6 rows" in str(e.value)
