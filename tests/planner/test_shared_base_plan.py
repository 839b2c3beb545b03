"""The reference scored as the LoRA actor's base (and the reward model as the LoRA critic's):
the graph's rewrite, the simulator's memory (one base per placement, nothing moved), the
C++ core equal to its twin on such problems, the plan and its table, the experiment's
decision (same checkpoint, share_base), and the 70B PPO with LoRA on 8 A100-80G."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import yaml

from planner.cost.cost_model import CostModel
from planner.errors import PlanError
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.shared_base import base_calls, share_base
from planner.search.anneal import AnnealSettings, anneal
from planner.search.core_bridge import core_anneal, core_simulate, to_core
from planner.search.problem import RoleModel, build_problem, head_of
from planner.search.simulator import memory, needs_realloc, off_training_placement, simulate
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.lora import LoraSpec
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[2]
SHAPE = BatchShape(prompts_per_step=8, samples_per_prompt=2, prompt_len=64, gen_len=64)


def _models(roles, lora_roles, preset="tiny-llama"):
    spec = model_presets()[preset]
    return {r: RoleModel(r, spec, head_of(r), LoraSpec(rank=8) if r in lora_roles else None)
            for r in roles}


def test_share_base_makes_the_reference_a_call_of_the_actor_with_its_adapters_off():
    g = build_graph("ppo", SHAPE, {"actor", "critic", "ref", "reward"})
    s = share_base(share_base(g, "ref", "actor"), "reward", "critic")
    ref = s.mfc("ref.inference")
    assert (ref.role, ref.kind, ref.adapters_off) == ("actor", "inference", True)
    assert ref.input_keys == g.mfc("ref.inference").input_keys
    assert ref.output_keys == ("ref_logprobs",)
    assert s.mfc("reward.inference").role == "critic"
    assert sorted(s.roles()) == ["actor", "critic"]
    assert base_calls(s) == ["reward.inference", "ref.inference"]
    assert [m.name for m in s.mfcs] == [m.name for m in g.mfcs]
    assert share_base(g, "ref", "actor") == share_base(share_base(g, "ref", "actor"), "ref",
                                                       "actor")      # nothing left to move
    with pytest.raises(PlanError, match="only a frozen role's scoring"):
        share_base(g, "critic", "actor")                  # critic.train is no scoring
    with pytest.raises(PlanError, match="calls no critic"):
        share_base(build_graph("grpo", SHAPE, {"actor", "ref"}), "ref", "critic")


def _problem(n_gpus=4, lora=True, shared=True):
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=n_gpus, device=resolve_device("a100-80g"))
    g = build_graph("grpo", SHAPE, {"actor", "ref"})
    if shared:
        g = share_base(g, "ref", "actor")
    return build_problem(g, _models({"actor", "ref"}, {"actor"} if lora else set()),
                         CostModel(cluster))


def _pick(prob, i, first_gpu, n_gpus, tp, pp=1):
    for j, c in enumerate(prob.cands[i]):
        if (c.first_gpu, c.n_gpus, c.tp, c.pp) == (first_gpu, n_gpus, tp, pp):
            return j
    raise AssertionError(f"no candidate of MFC {i} on {first_gpu}+{n_gpus} tp{tp} pp{pp}")


def test_the_base_is_counted_once_per_placement_and_never_reallocated():
    prob = _problem()
    names = [m.name for m in prob.graph.mfcs]
    gen, ref, train = (names.index(n) for n in ("actor.generate", "ref.inference",
                                                  "actor.train"))
    assert prob.mfc_base == [n == "ref.inference" for n in names]
    assert [m.role for m in prob.models] == ["actor"]
    # the base with the adapters off is priced without them: the base weights alone,
    # what a LoRA generate call keeps resident on its placement
    assert (prob.cands[ref][_pick(prob, ref, 0, 4, 1)].resident_bytes
            == prob.cands[gen][_pick(prob, gen, 0, 4, 1)].resident_bytes)

    def assign(ref_at, gen_at):
        a = [0] * len(names)
        a[train] = _pick(prob, train, 0, 2, 2)
        a[gen] = _pick(prob, gen, *gen_at)
        a[ref] = _pick(prob, ref, *ref_at)
        return a
    on_train = assign((0, 2, 2), (2, 2, 1))     # the reference where the actor trains
    on_gen = assign((2, 2, 1), (2, 2, 1))       # ... where it generates
    alone = assign((2, 2, 1), (0, 2, 1))        # ... on GPUs nothing else of it uses
    assert not off_training_placement(prob, on_train, ref)
    for a in (on_train, on_gen, alone):
        assert not needs_realloc(prob, a, ref)
        assert needs_realloc(prob, a, gen)      # the generation still gets the adapters
        assert all(i != ref for _, i in simulate(prob, a).realloc)

    def c(a, i):
        return prob.cands[i][a[i]]
    t = c(on_train, train)
    peak, _ = memory(prob, on_train)            # the training state holds the base
    assert peak[0] == pytest.approx(t.resident_bytes + max(t.activation_bytes,
                                                           c(on_train, ref).activation_bytes))
    g, r = c(on_gen, gen), c(on_gen, ref)
    peak, _ = memory(prob, on_gen)              # the generation's base, counted once
    assert peak[2] == pytest.approx(g.resident_bytes + max(
        g.activation_bytes + g.weights_bytes, r.activation_bytes))
    r = c(alone, ref)
    peak, _ = memory(prob, alone)               # its own copy of the base, once
    assert peak[2] == pytest.approx(r.resident_bytes + r.activation_bytes)


def test_a_separate_reference_costs_a_second_base_where_the_shared_one_does_not():
    shared, separate = _problem(), _problem(shared=False)
    names = [m.name for m in shared.graph.mfcs]
    assert [m.role for m in separate.models] == ["actor", "ref"]
    # everything on GPUs 0-3 at TP 2: the shared plan holds one base, the separate two
    a_s = [_pick(shared, i, 0, 4, 2) for i in range(len(names))]
    a_p = [_pick(separate, i, 0, 4, 2) for i in range(len(names))]
    assert [c.activation_bytes for c in (shared.cands[i][a_s[i]] for i in range(len(names)))] \
        == [c.activation_bytes for c in (separate.cands[i][a_p[i]] for i in range(len(names)))]
    ref = names.index("ref.inference")
    base = separate.cands[ref][a_p[ref]].resident_bytes
    diff = max(memory(separate, a_p)[0]) - max(memory(shared, a_s)[0])
    assert diff == pytest.approx(base)


def _random_shared_problem(rng: random.Random):
    presets = ("tiny-llama", "tiny-llama-8l", "tiny-qwen", "llama2-7b")
    while True:
        alg = rng.choice(("ppo", "grpo", "dpo", "remax"))
        roles = {"actor", "ref"} | ({"critic", "reward"} if alg == "ppo" else set())
        shape = BatchShape(prompts_per_step=rng.choice((4, 8, 16)),
                           samples_per_prompt=rng.choice((1, 2)),
                           prompt_len=rng.choice((16, 64)), gen_len=rng.choice((16, 64, 256)),
                           ppo_minibatches=rng.choice((1, 2)))
        cluster = ClusterSpec(n_nodes=rng.randint(1, 2), gpus_per_node=rng.choice((2, 4, 8)),
                              device=resolve_device(rng.choice(("a100-80g", "cpu"))))
        spec = rng.choice(presets)
        lora = {"actor", "critic"} & roles
        try:
            g = share_base(build_graph(alg, shape, roles), "ref", "actor")
            if alg == "ppo":
                g = share_base(g, "reward", "critic")
            prob = build_problem(g, _models(roles, lora, spec), CostModel(cluster),
                                 n_iters=rng.randint(1, 3))
        except PlanError:
            continue
        return prob


def test_core_equals_its_twin_on_shared_bases():
    n_base_off = n_realloc = 0
    for k in range(10):
        rng = random.Random(500 + k)
        prob = _random_shared_problem(rng)
        if k % 2:       # a limit random plans often overflow
            peaks = sorted(max(simulate(prob, [rng.randrange(len(c)) for c in prob.cands])
                               .peak_bytes) for _ in range(4))
            prob = dataclasses.replace(prob, mem_limit_bytes=peaks[1])
        cp = to_core(prob)
        for _ in range(40):
            a = [rng.randrange(len(c)) for c in prob.cands]
            py, cc = simulate(prob, a), core_simulate(prob, a, cp)
            assert (cc.iter_time_s, cc.makespan_s, cc.overflow_bytes, list(cc.peak_bytes)) == \
                (py.iter_time_s, py.makespan_s, py.overflow_bytes, list(py.peak_bytes))
            n_base_off += any(prob.mfc_base[i] and off_training_placement(prob, a, i)
                              for i in range(len(a)))
            n_realloc += any(needs_realloc(prob, a, i) for i in range(len(a)))
        settings = AnnealSettings(n_steps=300, t0_frac=0.1, t1_frac=1e-3, restart_every=97,
                                  seed=rng.randrange(2 ** 32))
        start = [rng.randrange(len(c)) for c in prob.cands]
        py_a, cc_a = anneal(prob, start, settings), core_anneal(prob, start, settings,
                                                                core_prob=cp)
        assert (cc_a.assign, cc_a.energy, cc_a.steps) == (py_a.assign, py_a.energy, py_a.steps)
    assert n_base_off > 50 and n_realloc > 50


def _experiment(name: str, **changes):
    from realign.config.experiment import ExperimentConfig
    raw = yaml.safe_load((ROOT / "experiments/public" / name).read_text())
    for path, value in changes.items():
        node = raw
        *head, last = path.split("__")
        for h in head:
            node = node.setdefault(h, {})
        node[last] = value
    return ExperimentConfig(**raw)


def test_which_roles_share_a_base():
    from realign.run.shared_base import same_checkpoint, shared_bases

    base = ROOT / "experiments"
    cfg = _experiment("ppo-llama2-70b-8gpu-lora.yaml")
    trained = {"actor", "critic"}
    assert shared_bases(cfg, trained) == {"ref": "actor", "reward": "critic"}
    off = _experiment("ppo-llama2-70b-8gpu-lora.yaml", lora__actor__share_base=False)
    assert shared_bases(off, trained) == {"reward": "critic"}
    other = _experiment("ppo-llama2-70b-8gpu-lora.yaml", models__ref="llama2-13b")
    assert shared_bases(other, trained) == {"reward": "critic"}
    no_lora = _experiment("ppo-llama2-70b-8gpu-lora.yaml", lora={"critic": {"rank": 8}})
    assert shared_bases(no_lora, trained) == {"reward": "critic"}
    assert same_checkpoint(str(base / "tiny/actor"), str(base / "tiny/actor/config.json"))
    assert same_checkpoint(str(base / "../experiments/tiny/actor"), str(base / "tiny/actor"))
    assert not same_checkpoint(str(base / "tiny/actor"), str(base / "tiny/reward"))


def test_70b_ppo_with_lora_plans_on_8_a100s_with_one_base_each():
    from planner.plan import ExecutionPlan
    from planner.report import summary, table
    from realign.run.planning import plan_experiment

    cfg = _experiment("ppo-llama2-70b-8gpu-lora.yaml", plan__time_limit_s=20)
    plan = plan_experiment(cfg)
    assert [m.role for m in plan.models] == ["actor", "critic"]
    assert max(plan.peak_mem_bytes) <= plan.mem_limit_bytes
    assert plan.reallocations == () or all(
        not plan.graph.mfc(r.to_mfc).adapters_off for r in plan.reallocations)
    ref, reward = plan.allocation("ref.inference"), plan.allocation("reward.inference")
    assert (ref.role, reward.role) == ("actor", "critic")
    # the base runs where the LoRA model already holds it
    assert ref.shards in {a.shards for a in plan.allocations
                          if a.role == "actor" and a.mfc != "ref.inference"}
    assert reward.shards in {a.shards for a in plan.allocations
                             if a.role == "critic" and a.mfc != "reward.inference"}
    assert ExecutionPlan.from_json(plan.to_json()) == plan
    text = table(plan)
    assert "ref.inference (actor base)" in text and "reward.inference (critic base)" in text
    assert "actor: one frozen base; ref.inference runs it with the adapters off" in text
    rows = {m["name"]: m for m in summary(plan)["mfcs"]}
    assert rows["ref.inference"]["adapters_off"] and rows["ref.inference"]["role"] == "actor"
    # without sharing the four frozen 70B weights do not fit on 8 GPUs
    off = _experiment("ppo-llama2-70b-8gpu-lora.yaml", plan__time_limit_s=20,
                      lora__actor__share_base=False, lora__critic__share_base=False)
    with pytest.raises(PlanError):
        plan_experiment(off)
