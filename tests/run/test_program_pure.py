"""The compiled program is the one interpreter of an execution plan: every field of
every allocation (of every MFC kind) and every listed reallocation changes what runs
or is refused, the reallocations run are the plan's, rule rewards and dataset keys
come from the graph, and the estimates the run holds itself to are the plan's."""
from __future__ import annotations

import json

import pytest

from planner.errors import PlanError
from planner.graph.algorithms import BatchShape, build_graph
from planner.plan import ExecutionPlan, MFCAllocation, Reallocation
from planner.search.manual import manual_plan
from planner.search.problem import RoleModel, head_of
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Allocation, Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets
from realign.run.ops import Call, Realloc, Release, RuleReward, Send
from realign.run.program import MIN_COLLECTIVE_TIMEOUT_S, TIMEOUT_SAFETY, compile_program

pytestmark = pytest.mark.pure

CLUSTER = ClusterSpec(n_nodes=1, gpus_per_node=4, device=resolve_device("cpu"))
SHAPE = BatchShape(prompts_per_step=16, samples_per_prompt=4, prompt_len=8, gen_len=4,
                   ppo_minibatches=1)


def alloc(first, n, tp=1, pp=1, mb=1) -> Allocation:
    return Allocation(mesh=DeviceMesh(first_gpu=first, n_gpus=n),
                      layout=Layout(tp=tp, pp=pp, dp=n // (tp * pp)), micro_batches=mb)


#: GRPO with a reference model on 4 devices: generation on GPUs 0-1 (reallocated from
#: training on all four), the reference on GPUs 2-3, rewards from a rule
BASE = {"actor.generate": alloc(0, 2), "ref.inference": alloc(2, 2),
        "actor.train": alloc(0, 4)}


def plan_of(allocs: dict[str, Allocation], roles=("actor", "ref"), alg="grpo"
            ) -> ExecutionPlan:
    spec = model_presets()["tiny-llama"]
    models = {r: RoleModel(r, spec, head_of(r)) for r in roles}
    graph = build_graph(alg, SHAPE, set(roles))
    return manual_plan("t", graph, models, CLUSTER, allocs)


def with_alloc(name: str, **kw) -> dict[str, Allocation]:
    a = BASE[name]
    return {**BASE, name: alloc(kw.get("first", a.mesh.first_gpu), kw.get("n", a.mesh.n_gpus),
                                kw.get("tp", a.layout.tp), kw.get("pp", a.layout.pp),
                                kw.get("mb", a.micro_batches))}


def edited(plan: ExecutionPlan, edit) -> str:
    raw = json.loads(plan.to_json())
    edit(raw)
    return json.dumps(raw)


def _alloc(raw, name):
    return next(a for a in raw["allocations"] if a["mfc"] == name)


def _variants(name: str) -> dict[str, object]:
    """One valid or refused variant of the base plan per field of ``name``'s
    allocation: a plan (made as a user would make it) or edited plan JSON."""
    base = plan_of(BASE)
    return {
        "mfc": edited(base, lambda r: _alloc(r, name).update(mfc=name + "2")),
        "role": edited(base, lambda r: _alloc(r, name).update(role="critic")),
        "kind": edited(base, lambda r: _alloc(r, name).update(
            kind="inference" if name != "ref.inference" else "generate")),
        "mesh": plan_of(with_alloc(name, first=2 if BASE[name].mesh.first_gpu == 0 else 0,
                                   n=2)),
        "mesh_name": edited(base, lambda r: _alloc(r, name).update(mesh_name="n9")),
        "layout": plan_of(with_alloc(name, tp=2)),
        "micro_batches": plan_of(with_alloc(name, mb=2)),
        "time_s": edited(base, lambda r: _alloc(r, name).update(time_s=7.0)),
        "mem_bytes": edited(base, lambda r: _alloc(r, name).update(mem_bytes=1234.0)),
        # a train call runs with its optimizer state on the host; another kind is refused
        "optimizer_offload": edited(base, lambda r: _alloc(r, name).update(
            optimizer_offload=True)),
        "host_bytes": edited(base, lambda r: _alloc(r, name).update(host_bytes=4096.0)),
        # a train call parks its training state between calls; another kind is refused
        "train_state_offload": edited(base, lambda r: _alloc(r, name).update(
            train_state_offload=True)),
        "activation_recompute": edited(base, lambda r: _alloc(r, name).update(
            activation_recompute=True)),
        # a generate call on vLLM; another kind is refused
        "engine": edited(base, lambda r: _alloc(r, name).update(engine="vllm")),
        # a packed scoring call packs by it; another call is refused
        "token_budget": edited(base, lambda r: _alloc(r, name).update(token_budget=512)),
    }


def _compiled(variant):
    """The program of a variant, or the PlanError that refuses it."""
    try:
        plan = variant if isinstance(variant, ExecutionPlan) else ExecutionPlan.from_json(variant)
        return compile_program(plan)
    except PlanError as e:
        return e


def assert_each_consumed(variants: dict, fields, what: str) -> None:
    """Every field has a variant, and each variant compiles to another program than the
    base plan's or is refused."""
    base = compile_program(plan_of(BASE))
    assert set(variants) == set(fields), "a field without a variant"
    for field, variant in variants.items():
        got = _compiled(variant)
        assert isinstance(got, PlanError) or got != base, f"{what}.{field} is not consumed"


@pytest.mark.parametrize("name", list(BASE))           # generate, inference, train
def test_every_allocation_field_changes_the_program_or_is_refused(name):
    """A field nobody reads cannot slip into the plan: each one, varied alone, gives
    another program or a refusal that names what is wrong."""
    assert_each_consumed(_variants(name), MFCAllocation.model_fields, name)


def test_every_reallocation_field_changes_the_program_or_is_refused():
    plan = plan_of(BASE)
    assert len(plan.reallocations) == 1
    r = plan.reallocations[0]

    def realloc(**kw):
        return edited(plan, lambda raw: raw["reallocations"][0].update(kw))

    variants = {
        "role": realloc(role="ref"), "to_mfc": realloc(to_mfc="ref.inference"),
        "src_mesh": realloc(src_mesh={"first_gpu": 0, "n_gpus": 2}),
        "src_layout": realloc(src_layout={"tp": 4, "pp": 1, "dp": 1}),
        "dst_mesh": realloc(dst_mesh={"first_gpu": 2, "n_gpus": 2}),
        "dst_layout": realloc(dst_layout={"tp": 2, "pp": 1, "dp": 1}),
        "bytes": realloc(bytes=r.bytes + 2), "time_s": realloc(time_s=r.time_s + 1.0),
    }
    assert_each_consumed(variants, Reallocation.model_fields, "reallocation")


def test_the_program_runs_the_plans_allocations_and_reallocations():
    plan = plan_of(BASE)
    prog = compile_program(plan)
    kinds = [type(op).__name__ for op in prog.ops]
    assert kinds == ["Realloc", "Call", "RuleReward", "Release", "Send", "Call", "Send",
                     "Send", "Send", "Call"]
    realloc, gen, rule, release, send_seqs, ref, *_sends, train = prog.ops
    r = plan.reallocations[0]
    assert isinstance(realloc, Realloc)
    assert (realloc.to_mfc, realloc.bytes, realloc.estimate_s) == (r.to_mfc, r.bytes, r.time_s)
    assert realloc.dtype_bytes == plan.cost_config.param_dtype_bytes
    assert realloc.ranks == (0, 1, 2, 3) and realloc.dst == gen.replica != train.replica
    for op in (gen, ref, train):
        a = plan.allocation(op.name)
        assert isinstance(op, Call) and op.mfc == next(m for m in plan.graph.mfcs
                                                       if m.name == op.name)
        assert (op.ranks, op.micro_batches, op.mesh_name, op.estimate_s,
                op.estimate_mem_bytes) == (tuple(a.mesh.gpus), a.micro_batches, a.mesh_name,
                                           a.time_s, a.mem_bytes)
    assert isinstance(rule, RuleReward) and (rule.seqs_key, rule.out_key) == ("seqs", "rewards")
    assert isinstance(release, Release) and release.replica == gen.replica
    assert isinstance(send_seqs, Send) and send_seqs.key == "seqs"
    assert (send_seqs.src_ranks, send_seqs.dst_ranks) == ((0, 1), (2, 3))
    # training reads exactly its graph inputs; the records it lacks come to it
    assert train.inputs == ("seqs", "logprobs", "ref_logprobs", "rewards")
    sent = {op.key: op.dst_ranks for op in prog.ops if isinstance(op, Send)}
    assert sent == {"seqs": (2, 3), "logprobs": (2, 3), "rewards": (2, 3),
                    "ref_logprobs": (0, 1)}
    replicas = {rep.key: rep for rep in prog.replicas}
    assert replicas[gen.replica].reallocated and not replicas[gen.replica].trained
    assert replicas[train.replica].trained and not replicas[train.replica].reallocated
    assert prog.dataset_keys == ("prompts",) and prog.n_ranks == 4
    assert all(op.every == 1 for op in prog.ops) and not prog.evaluates


def test_no_reallocation_when_the_plan_lists_none():
    """Generation on the training placement: no Realloc, no Release."""
    prog = compile_program(plan_of({**BASE, "actor.generate": alloc(0, 4)}))
    assert not any(isinstance(op, (Realloc, Release)) for op in prog.ops)


def test_rule_rewards_and_dataset_keys_come_from_the_graph():
    """ReMax without a reward model: both generations are scored by the rule, and
    training reads the two reward records (no special case for the greedy rollout)."""
    allocs = {"actor.generate": alloc(0, 4), "actor.greedy_generate": alloc(0, 4),
              "actor.train": alloc(0, 4)}
    prog = compile_program(plan_of(allocs, roles=("actor",), alg="remax"))
    rules = [(op.seqs_key, op.out_key) for op in prog.ops if isinstance(op, RuleReward)]
    assert rules == [("seqs", "rewards"), ("greedy_seqs", "greedy_rewards")]
    greedy = next(op for op in prog.ops if isinstance(op, Call) and op.name.endswith("greedy_generate"))
    assert greedy.mfc.greedy and greedy.mfc.n_seqs == 16
    train = next(op for op in prog.ops if isinstance(op, Call) and op.kind == "train")
    assert train.inputs == ("seqs", "logprobs", "rewards", "greedy_rewards")
    dpo = plan_of({"ref.inference": alloc(0, 4), "actor.train": alloc(0, 4)}, alg="dpo")
    assert compile_program(dpo).dataset_keys == ("pairs",)


def test_the_estimates_the_run_holds_itself_to():
    plan = plan_of(BASE)
    prog = compile_program(plan)
    serial = sum(a.time_s for a in plan.allocations) + sum(r.time_s for r in plan.reallocations)
    assert prog.collective_timeout_s() == max(MIN_COLLECTIVE_TIMEOUT_S, TIMEOUT_SAFETY * serial)
    slow = ExecutionPlan.from_json(edited(plan, lambda r: _alloc(r, "actor.train").update(
        time_s=1000.0)))
    assert compile_program(slow).collective_timeout_s() == pytest.approx(
        TIMEOUT_SAFETY * (serial - plan.allocation("actor.train").time_s + 1000.0))
    need = plan.allocation("ref.inference").mem_bytes
    assert prog.memory_shortfall(3, free_bytes=need) is None
    msg = prog.memory_shortfall(3, free_bytes=need / 2)
    assert "GPU 3" in msg and "while" in msg
    assert prog.memory_shortfall(7, free_bytes=0) is None       # a rank with no call


def test_an_evaluation_runs_after_training_on_evaluation_steps_only():
    """The eval section adds a greedy and a sampled generation on held-out prompts after
    the training call (they read its output, so they see the trained policy), priced at
    1/every of their time per step; their ops (and their reallocations and releases)
    run only on evaluation steps, and each is scored by an Evaluate op."""
    from planner.graph.algorithms import EvalShape
    from realign.run.ops import Evaluate

    spec = model_presets()["tiny-llama"]
    models = {"actor": RoleModel("actor", spec, "lm")}
    graph = build_graph("grpo", SHAPE, {"actor"}, evaluation=EvalShape(n_prompts=8, every=5))
    allocs = {"actor.generate": alloc(0, 2), "actor.train": alloc(0, 4),
              "actor.eval_greedy": alloc(0, 2), "actor.eval_sample": alloc(2, 2)}
    plan = manual_plan("t", graph, models, CLUSTER, allocs)
    prog = compile_program(plan)
    names = [m.name for m in graph.mfcs]
    assert names[-2:] == ["actor.eval_greedy", "actor.eval_sample"]
    assert graph.mfc("actor.eval_greedy").input_keys == ("eval_prompts", "actor_stats")
    assert prog.dataset_keys == ("eval_prompts", "prompts") and prog.evaluates
    step_ops = prog.ops_for(evaluate=False)
    assert all(op.every == 1 for op in step_ops)
    assert not any(isinstance(op, Evaluate) for op in step_ops)
    every = [op for op in prog.ops if op.every == 5]
    # each generation on its own reallocated copy (greedy on the rollout's, freed on
    # ordinary steps after the rollout and here after the evaluation), scored there
    assert [type(op).__name__ for op in every] == [
        "Realloc", "Call", "Evaluate", "Release", "Realloc", "Call", "Evaluate", "Release"]
    assert [(op.seqs_key, op.prompts_key, op.name) for op in every if isinstance(op, Evaluate)] \
        == [("eval_greedy_seqs", "eval_prompts", "greedy"),
            ("eval_sample_seqs", "eval_prompts", "sample")]
    # a call made every 5 steps costs a fifth of its time per step in the estimate, and
    # its allocation states what one call takes
    a = plan.allocation("actor.eval_sample")
    greedy_and_sample = [e for e in plan.timeline if e.name == "actor.eval_sample"]
    assert greedy_and_sample[0].end_s - greedy_and_sample[0].start_s == pytest.approx(a.time_s / 5)


def test_a_packed_scoring_calls_token_budget_reaches_its_call():
    from planner.cost.cost_config import CostModelConfig
    from planner.graph.packing import packed_graph
    from planner.search.search import search
    spec = model_presets()["tiny-llama"]
    models = {r: RoleModel(r, spec, head_of(r)) for r in ("actor", "ref")}
    graph = packed_graph(build_graph("grpo", BatchShape(prompts_per_step=16, gen_len=64),
                                     {"actor", "ref"}))
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("cpu"))
    plan = search("t", graph, models, cluster, CostModelConfig())
    calls = {op.name: op for op in compile_program(plan).ops if isinstance(op, Call)}
    assert calls["ref.inference"].token_budget == plan.allocation("ref.inference").token_budget
    assert calls["ref.inference"].token_budget is not None
    # a packed train call runs the plan's token budget too (bins of whole groups)
    assert calls["actor.train"].token_budget == plan.allocation("actor.train").token_budget
