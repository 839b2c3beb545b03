"""DAPO's sampling rounds in the compiled program (the span that runs again) and the
worker's pure parts of the loop (which groups a round keeps, records joined across
rounds, metrics added up)."""
from __future__ import annotations

import pytest
import torch

from planner.graph.algorithms import BatchShape, build_graph
from planner.search.manual import manual_plan
from planner.search.problem import RoleModel, head_of
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Allocation, Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets
from realign.run.ops import Call, Release, RuleReward, Send
from realign.run.program import compile_program
from realign.worker.sampling_loop import (
    choose_groups,
    concat_records,
    group_rows,
    merge_round_metrics,
    take_rows,
)

pytestmark = pytest.mark.pure

CLUSTER = ClusterSpec(n_nodes=1, gpus_per_node=4, device=resolve_device("cpu"))
SHAPE = BatchShape(prompts_per_step=16, samples_per_prompt=4, prompt_len=8, gen_len=4,
                   ppo_minibatches=1, dropped_group_frac=0.2)


def alloc(first, n) -> Allocation:
    return Allocation(mesh=DeviceMesh(first_gpu=first, n_gpus=n),
                      layout=Layout(tp=1, pp=1, dp=n), micro_batches=1)


def dapo_plan(roles=("actor", "ref")):
    """Generation on GPUs 0-1 (reallocated from training on all four), the reference on
    2-3, rewards from a rule."""
    spec = model_presets()["tiny-llama"]
    models = {r: RoleModel(r, spec, head_of(r)) for r in roles}
    graph = build_graph("dapo", SHAPE, set(roles), max_sampling_rounds=3)
    allocs = {"actor.generate": alloc(0, 2), "actor.train": alloc(0, 4)}
    if "ref" in roles:
        allocs["ref.inference"] = alloc(2, 2)
    return manual_plan("t", graph, models, CLUSTER, allocs)


def test_the_span_is_the_rollout_and_its_scoring_and_releases_wait_for_it():
    plan = dapo_plan()
    once = compile_program(plan)
    assert once.rounds is None
    p = compile_program(plan, round_group_size=4)
    s = p.rounds
    assert s is not None
    span = p.ops[s.start:s.end]
    assert [type(op) for op in span] == [Call, RuleReward, Send, Call]
    assert [op.name for op in span if isinstance(op, Call)] == ["actor.generate",
                                                                 "ref.inference"]
    assert s.keys == ("seqs", "logprobs", "ref_logprobs", "rewards")
    assert (s.rewards_key, s.decider, s.group_size) == ("rewards", 0, 4)
    assert (s.groups_per_round, s.groups_wanted, s.role) == (20, 16, "actor")  # ceil(16/.8)
    assert not any(isinstance(op, Release) for op in span)
    # the generation copy is freed right after the span (once: right after generate)
    after = p.ops[s.end]
    assert isinstance(after, Release) and after.replica.startswith("actor@g0+2")
    first = once.ops.index(next(op for op in once.ops if isinstance(op, Call)))
    assert isinstance(once.ops[first + 2], Release)      # generate, reward, release
    # the same ops otherwise, in the same order
    assert [op for op in p.ops if not isinstance(op, Release)] == \
        [op for op in once.ops if not isinstance(op, Release)]


def test_a_rule_reward_only_span_ends_at_the_reward():
    p = compile_program(dapo_plan(("actor",)), round_group_size=4)
    s = p.rounds
    assert [type(op) for op in p.ops[s.start:s.end]] == [Call, RuleReward]
    assert s.keys == ("seqs", "logprobs", "rewards")


@pytest.mark.parametrize("constant,kept,reserved,wanted,info,const", [
    ([0, 1, 0, 1, 1], 2, 0, 3, [0], []),          # the docstring's example
    ([0, 1, 0, 1, 1], 0, 0, 3, [0, 2], [1]),      # short: one constant group reserved
    ([1, 1, 1, 1], 0, 0, 3, [], [0, 1, 2]),
    ([1, 1, 1, 1], 0, 2, 3, [], [0]),             # a reserve of 2 already: one more
    ([0, 0, 0, 0], 1, 3, 3, [0, 1], []),
])
def test_choose_groups(constant, kept, reserved, wanted, info, const):
    i, c = choose_groups(torch.tensor(constant, dtype=torch.bool), kept, reserved, wanted)
    assert i.tolist() == info and c.tolist() == const


def test_records_join_across_rounds_padded_to_the_widest():
    a = {"tokens": torch.tensor([[5, 6], [1, 2]]), "lengths": torch.tensor([2, 2]),
         "texts": ["a", "b"], "note": 7}
    b = {"tokens": torch.tensor([[7, 8, 9]]), "lengths": torch.tensor([3]), "texts": ["c"],
         "note": 7}
    out = concat_records([a, b], pad_id=0)
    assert out["tokens"].tolist() == [[5, 6, 0], [1, 2, 0], [7, 8, 9]]
    assert out["lengths"].tolist() == [2, 2, 3] and out["texts"] == ["a", "b", "c"]
    assert out["note"] == 7
    lp = concat_records([{"logprobs": torch.ones(1, 1)}, {"logprobs": torch.ones(1, 3)}], 9)
    assert lp["logprobs"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert group_rows(torch.tensor([2, 0]), 2).tolist() == [4, 5, 0, 1]
    assert take_rows(out, torch.tensor([2]))["texts"] == ["c"]


def test_round_metrics_add_up_where_they_count():
    total = {"gen_tokens": 10.0, "decode_steps.actor.generate": 4.0, "reward_mean": 0.5,
             "response_len_hist": [[3, 2], [4, 1]]}
    merge_round_metrics(total, {"gen_tokens": 6.0, "decode_steps.actor.generate": 3.0,
                                "reward_mean": 0.25, "response_len_hist": [[4, 2], [5, 1]]})
    assert total == {"gen_tokens": 16.0, "decode_steps.actor.generate": 7.0,
                     "reward_mean": 0.25, "response_len_hist": [[3, 2], [4, 3], [5, 1]]}
