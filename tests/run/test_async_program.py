"""The compiled program of an asynchronous plan: reallocate the generating weights
first, train on the rollout the previous step made, generate the next one on its own
ranks; a prologue makes the first step's own rollout, the last step makes none."""
from __future__ import annotations

import pytest

from planner.graph.algorithms import BatchShape, build_graph
from planner.search.manual import manual_plan
from planner.search.problem import RoleModel
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Allocation, Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets
from realign.run.ops import Call, Realloc, Release, RuleReward, Send
from realign.run.program import compile_program

pytestmark = pytest.mark.pure

CPU2 = ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("cpu"))
SHAPE = BatchShape(prompts_per_step=4, samples_per_prompt=2, prompt_len=8, gen_len=4,
                   ppo_minibatches=1)


def alloc(first, n):
    return Allocation(mesh=DeviceMesh(first_gpu=first, n_gpus=n),
                      layout=Layout(tp=1, pp=1, dp=n), micro_batches=1)


def program(gen=(0, 1), rest=(1, 1)):
    graph = build_graph("grpo", SHAPE, {"actor"}, max_staleness=1, asynchronous=True)
    tiny = {"actor": RoleModel("actor", model_presets()["tiny-llama"], "lm")}
    plan = manual_plan("t", graph, tiny, CPU2, {"actor.generate": alloc(*gen),
                                                "actor.prox_inference": alloc(*rest),
                                                "actor.train": alloc(*rest)})
    return compile_program(plan)


def describe(op):
    return (type(op).__name__, getattr(op, "name", getattr(op, "key", "")),
            getattr(op, "ahead", False))


def test_step_order_of_an_asynchronous_program():
    p = program()
    assert p.asynchronous and p.ahead_ranks == (0,) and p.max_staleness == 1 and p.head == 1
    # the previous step's rollout leaves the generating rank at once, so its next
    # generation waits for no call of the training rank
    assert [describe(op) for op in p.ops] == [
        ("Realloc", "", False), ("Send", "seqs", False), ("Send", "logprobs", False),
        ("Send", "rewards", False), ("Call", "actor.prox_inference", False),
        ("Call", "actor.train", False), ("Call", "actor.generate", True),
        ("RuleReward", "", True), ("Release", "", False)]
    head = p.ops[0]
    assert isinstance(head, Realloc) and head.to_mfc == "actor.generate"
    sends = [op for op in p.ops if isinstance(op, Send)]
    assert all(op.src_ranks == (0,) and op.dst_ranks == (1,) for op in sends)
    gen = next(op for op in p.ops if isinstance(op, Call) and op.ahead)
    assert not gen.sees_update            # it samples with the reallocated weights


def test_prologue_and_last_step():
    p = program()
    first = p.ops_for(False, prologue=True)
    assert [describe(op) for op in first[:4]] == [        # then the rollout's sends
        ("Realloc", "", False), ("Call", "actor.generate", False), ("RuleReward", "", False),
        ("Send", "seqs", False)]
    assert len(first) == len(p.ops) + 2
    last = p.ops_for(False, last=True)
    assert not any(getattr(op, "ahead", False) for op in last)
    assert isinstance(last[-1], Release)            # the copy is freed all the same
    assert [isinstance(op, RuleReward) for op in p.prologue] == [False, True]


def test_generation_on_the_trained_copy_samples_the_next_version():
    p = program(gen=(0, 2), rest=(0, 2))             # all on both: nothing reallocated
    gen = next(op for op in p.ops if isinstance(op, Call) and op.ahead)
    assert gen.sees_update and p.head == 0
    assert not any(isinstance(op, Realloc) for op in p.ops)
    assert not next(op for op in p.prologue if isinstance(op, Call)).sees_update
