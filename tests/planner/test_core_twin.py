"""The C++ search core against its Python twin, bit for bit (STYLE rule 10).

Random small problems (algorithm, batch shape, models, device, cluster shape) are
fed to both :mod:`planner._core` and the Python reference (planner.search.simulator,
planner.cost.realloc_cost, planner.search.anneal); every number must be *equal*, not close.
"""
from __future__ import annotations

import dataclasses
import random
import sys
import time

import pytest

import planner
from planner.cost.cost_model import CostModel
from planner.cost.realloc_cost import realloc_time
from planner.errors import PlanError
from planner.graph.algorithms import ALGORITHMS as SPECS
from planner.graph.algorithms import BatchShape, build_graph
from planner.graph.lengths import GenLengths
from planner.search.anneal import AnnealSettings, anneal
from planner.search.core_bridge import core_anneal, core_simulate, load_core, to_core
from planner.search.problem import Problem, RoleModel, build_problem, head_of
from planner.search.simulator import energy, needs_realloc, simulate
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.lora import LoraSpec
from planner.specs.model_spec import model_presets

pytestmark = pytest.mark.pure

N_INSTANCES = 36
ALGORITHMS = ("ppo", "grpo", "remax", "dpo", "sft", "rm")
MODELS = ("tiny-llama", "tiny-llama-8l", "tiny-qwen", "llama2-7b")
DEVICES = ("a100-80g", "h100-80g", "cpu")
GPUS_PER_NODE = (2, 3, 4, 6, 8)


def random_problem(rng: random.Random, lora: bool = False) -> Problem:
    """A random small problem; draws again when the draw has no plan at all. ``lora``:
    the trainable roles carry rank-16 LoRA adapters (no extra draw)."""
    presets = model_presets()
    while True:
        alg = rng.choice(ALGORITHMS)
        roles = set(SPECS[alg].required_roles) | ({"ref"} & set(SPECS[alg].optional_roles))
        if alg in ("grpo", "remax") and rng.random() < 0.5:
            roles.add("reward")
        shape = BatchShape(prompts_per_step=rng.choice((2, 4, 8, 16, 32)),
                           samples_per_prompt=rng.choice((1, 2)),
                           prompt_len=rng.choice((16, 64, 128)),
                           gen_len=rng.choice((16, 64, 256)),
                           ppo_minibatches=rng.choice((1, 2)),
                           ppo_epochs=rng.choice((1, 2)))
        cluster = ClusterSpec(n_nodes=rng.randint(1, 4),
                              gpus_per_node=rng.choice(GPUS_PER_NODE),
                              device=resolve_device(rng.choice(DEVICES)))
        models = {r: RoleModel(r, presets[rng.choice(MODELS)], head_of(r),
                               LoraSpec(rank=16) if lora and r != "ref" else None)
                  for r in roles}
        try:
            asynchronous = SPECS[alg].generates and rng.random() < 0.5
            # responses of varying length (no extra draw: the instances stay the same)
            lengths = (GenLengths(max_len=shape.gen_len, mean=shape.gen_len / 4)
                       if asynchronous and shape.gen_len >= 64 else None)
            graph = build_graph(alg, shape, roles, lengths=lengths,
                                max_staleness=int(asynchronous), asynchronous=asynchronous)
            prob = build_problem(graph, models, CostModel(cluster), n_iters=rng.randint(1, 3))
            # realign's own time between steps (a profile's, here drawn)
            return dataclasses.replace(prob, step_overhead_s=rng.choice((0.0, 1e-3, 0.37)))
        except PlanError:
            continue


def random_assign(rng: random.Random, prob: Problem) -> list[int]:
    return [rng.randrange(len(cs)) for cs in prob.cands]


def tight(prob: Problem, rng: random.Random) -> Problem:
    """The same problem with a memory limit that random assignments often overflow."""
    peaks = [max(simulate(prob, random_assign(rng, prob)).peak_bytes) for _ in range(4)]
    return dataclasses.replace(prob, mem_limit_bytes=sorted(peaks)[1])


def sim_numbers(r) -> tuple:
    return (r.iter_time_s, r.makespan_s, r.overflow_bytes, list(r.peak_bytes))


@pytest.fixture(scope="module")
def instances() -> list[tuple[Problem, object, random.Random]]:
    """(problem, its core problem, a generator) per instance; half of them tight."""
    out = []
    for k in range(N_INSTANCES):
        rng = random.Random(1000 + k)
        prob = random_problem(rng, lora=k % 3 == 2)
        if k % 2 == 1:
            prob = tight(prob, rng)
        out.append((prob, to_core(prob), rng))
    return out


def test_instances_cover_the_cases(instances):
    """The random instances exercise what the twin test is meant to compare."""
    algs = {p.graph.algorithm for p, _, _ in instances}
    assert algs == set(ALGORITHMS)
    assert any(p.n_gpus >= 16 for p, _, _ in instances)
    assert any(any(t >= 0 for t in p.model_train_mfc) and len(p.cands) > 1
               for p, _, _ in instances)
    # LoRA models: the frozen base stays where it is reallocated to
    assert any(any(p.model_lora) for p, _, _ in instances)
    # asynchronous steps whose sides' times spread (the slower side per step)
    assert any(c.time_sd_s > 0 for p, _, _ in instances for cs in p.cands for c in cs
               if any(p.ahead))


def test_simulate_is_identical(instances):
    n_infeasible = n_feasible = n_realloc = 0
    for prob, cp, rng in instances:
        for _ in range(50):
            assign = random_assign(rng, prob)
            py = simulate(prob, assign)
            cc = core_simulate(prob, assign, cp)
            assert sim_numbers(cc) == sim_numbers(py), (prob.graph.algorithm, assign)
            n_feasible += py.feasible
            n_infeasible += not py.feasible
            n_realloc += any(needs_realloc(prob, assign, i) for i in range(len(assign)))
    assert n_feasible > 50 and n_infeasible > 50 and n_realloc > 50


def test_realloc_time_is_identical(instances):
    core = load_core()
    n_moved = 0
    for prob, cp, rng in instances:
        for model, rm in enumerate(prob.realloc_models):
            mfcs = [i for i, m in enumerate(prob.mfc_model) if m == model]
            for _ in range(30):
                src = rng.choice(prob.cands[rng.choice(mfcs)]).place
                dst = rng.choice(prob.cands[rng.choice(mfcs)]).place
                py = realloc_time(rm, src, dst, prob.links)
                assert core.realloc_time(cp, model, src, dst) == py, (rm, src, dst)
                n_moved += py[1] > 0
            # A placement moved onto itself moves nothing over the wire; it still pays
            # the fixed cost and copying its shards locally.
            itself = core.realloc_time(cp, model, src, src)
            assert itself == realloc_time(rm, src, src, prob.links) and itself[1] == 0
            assert itself[0] >= prob.links.fixed_s
    assert n_moved > 500


def test_anneal_is_identical(instances):
    n_feasible = n_infeasible = 0
    for k, (prob, cp, rng) in enumerate(instances):
        settings = AnnealSettings(n_steps=rng.choice((300, 600)),
                                  t0_frac=rng.choice((0.05, 0.2)),
                                  t1_frac=rng.choice((1e-4, 1e-2)),
                                  restart_every=rng.choice((0, 50, 97, 250)),
                                  seed=rng.randrange(2**64))
        start = random_assign(rng, prob)
        py = anneal(prob, start, settings)
        cc = core_anneal(prob, start, settings, core_prob=cp)
        assert (cc.assign, cc.energy, cc.feasible, cc.steps, cc.accepted) == \
            (py.assign, py.energy, py.feasible, py.steps, py.accepted), k
        n_feasible += py.feasible
        n_infeasible += not py.feasible
        if py.feasible:
            assert energy(prob, simulate(prob, py.assign)) == py.energy
    assert n_feasible > 10


def test_bad_input_is_a_value_error(instances):
    prob, cp, _ = instances[0]
    bad = [len(cs) for cs in prob.cands]  # one past the last candidate of every MFC
    with pytest.raises(ValueError, match=r"assign\[0\]"):
        core_simulate(prob, bad, cp)
    with pytest.raises(ValueError, match="t0_frac"):
        core_anneal(prob, [0] * len(prob.cands), AnnealSettings(t0_frac=0.0), core_prob=cp)
    broken = dataclasses.replace(prob, mfc_model=[99] * len(prob.cands))
    with pytest.raises(ValueError, match=r"mfc_model\[0\]"):
        to_core(broken)


def test_missing_extension_says_how_to_build(monkeypatch):
    monkeypatch.delattr(planner, "_core", raising=False)
    monkeypatch.setitem(sys.modules, "planner._core", None)
    with pytest.raises(ImportError, match="make install"):
        load_core()


def _ppo_70b_128gpu() -> Problem:
    spec = model_presets()["llama2-70b"]
    roles = SPECS["ppo"].required_roles + ("ref",)
    graph = build_graph("ppo", BatchShape(prompts_per_step=512, gen_len=384), set(roles))
    cluster = ClusterSpec(n_nodes=16, gpus_per_node=8, device=resolve_device("h100-80g"))
    return build_problem(graph, {r: RoleModel(r, spec, head_of(r)) for r in roles},
                         CostModel(cluster))


@pytest.mark.slow
def test_anneal_128_gpus_200k_steps(record_property):
    """The search-sized problem: 200k C++ steps, and the result is what the Python
    simulator says of it."""
    prob = _ppo_70b_128gpu()
    assert prob.n_gpus == 128
    cp = to_core(prob)
    start = random_assign(random.Random(7), prob)
    settings = AnnealSettings(n_steps=200_000, restart_every=5000, seed=7)
    t = time.perf_counter()
    res = core_anneal(prob, start, settings, core_prob=cp)
    elapsed = time.perf_counter() - t
    steps_per_s = res.steps / elapsed
    record_property("steps_per_s", round(steps_per_s))
    print(f"\n128-GPU PPO llama2-70b: {res.steps} steps in {elapsed:.2f} s "
          f"({steps_per_s:,.0f} steps/s), {res.accepted} accepted, energy {res.energy:.3f} s")
    # (how fast is benchmarks/plan_speed's measurement, not an assertion here)
    assert res.steps == 200_000 and res.feasible
    assert energy(prob, simulate(prob, res.assign)) == res.energy
    assert res.energy < energy(prob, simulate(prob, start))
    # The twin agrees on this problem too (a short walk: Python is slow here).
    short = AnnealSettings(n_steps=300, restart_every=100, seed=11)
    py, cc = anneal(prob, start, short), core_anneal(prob, start, short, core_prob=cp)
    assert (cc.assign, cc.energy, cc.accepted) == (py.assign, py.energy, py.accepted)
    # With a time limit the walk stops early, at a 256-step check.
    limited = core_anneal(prob, start, settings, time_limit_s=0.05, core_prob=cp)
    assert 0 < limited.steps < 200_000 and limited.steps % 256 == 0
