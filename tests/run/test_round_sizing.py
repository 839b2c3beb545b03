"""DAPO's later sampling rounds sized from the measured drop rate on a worker
(realign/worker/sampling_loop.py): the loop driven through a compiled program's span on
one gloo rank, each round's rewards scripted, checking the prompts each round asks for,
the calls it runs (rows, micro-batches, waves) and the drop rate carried to later steps."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from planner.graph.sampling_rounds import round_size
from realign.errors import UserError
from realign.run.ops import Call
from realign.run.program import compile_program, round_quantum
from realign.worker.sampling_loop import DropRate, SamplingLoop, round_call
from tests.run.test_sampling_rounds_program import dapo_plan

pytestmark = pytest.mark.cpu_dist

G = 4                       # samples per prompt of dapo_plan's shape (16 kept, 20 a round)


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def rewards_of(groups: int, constant: int) -> torch.Tensor:
    """``groups`` groups of G rewards, the first ``constant`` of them all equal."""
    r = torch.arange(groups * G, dtype=torch.float32).remainder(G)
    r[:constant * G] = 1.0
    return r


def run_step(loop: SamplingLoop, ops, constant_per_round: list[int]):
    """Walk a step's ops; each round's rollout makes one record row per sequence and
    the scripted number of constant groups. (calls run, metrics)."""
    store: dict = {"prompts": {"tokens": torch.zeros(20, 2, dtype=torch.long)}}
    metrics: dict = {}
    calls: list[Call] = []
    for _, op in loop.walk(ops, store, metrics):
        if isinstance(op, Call) and op.kind == "generate":
            calls.append(op)
            rows = op.mfc.n_seqs
            assert store["prompts"]["tokens"].shape[0] * G == rows
            c = min(constant_per_round[loop.round], rows // G)
            store["seqs"] = {"tokens": torch.arange(rows).unsqueeze(1),
                             "lengths": torch.ones(rows, dtype=torch.long)}
            store["logprobs"] = {"logprobs": torch.zeros(rows, 1)}
            store["rewards"] = {"rewards": rewards_of(rows // G, c)}
    return calls, metrics, store


def make_loop(ops_span, history: DropRate, cap: int, quantum: int = 1):
    def prompts(r: int, n: int) -> dict:
        return {"prompts": {"tokens": torch.zeros(n, 2, dtype=torch.long)}}
    return SamplingLoop(ops_span, 4, 0, 0, prompts, history=history, cap_prompts=cap,
                        quantum=quantum, dps={})


def test_a_later_round_is_sized_from_this_step_and_earlier_steps_rates(one_rank):
    p = compile_program(dapo_plan(("actor",)), round_group_size=G)
    span = p.rounds
    assert span is not None and span.groups_per_round == 20 and span.groups_wanted == 16
    history = DropRate(dropped=6.0, generated=10.0)
    loop = make_loop(span, history, cap=200)
    # round 1: 17 of 20 constant (3 kept); round 2 sized at (6 + 17) / (10 + 20)
    calls, m, store = run_step(loop, p.ops, [17, 0, 0, 0])
    seen = 23 / 30
    second = round_size(13, seen, 200)
    assert second == 83 and m["actor.round_prompts"] == [20, second]   # 13 / 0.233 = 56 + margin
    assert m["actor.dropped_frac_seen"] == pytest.approx(seen)
    assert [c.mfc.n_seqs for c in calls] == [80, 4 * second]
    # the larger round decodes in more waves, none larger than the plan's
    assert calls[1].micro_batches == -(-calls[0].micro_batches * 4 * second // 80)
    assert m["actor.batch_full"] == 1.0 and m["actor.kept_groups"] == [3, 13]
    assert m["actor.generated_per_trained"] == (20 + second) / 16
    assert store["seqs"]["tokens"].shape[0] == 16 * G
    # the step's counts join the history, the earlier ones halved
    assert (history.dropped, history.generated) == (3.0 + 17.0, 5.0 + 20 + second)
    # every group constant: each later round larger, as the rate seen climbs from the
    # history's towards 1 ...
    loop = make_loop(span, history, cap=200)
    _, m, _ = run_step(loop, p.ops, [20, 200, 200, 200])
    sizes = m["actor.round_prompts"]
    assert sizes[0] == 20 and sizes[1] < sizes[2] < sizes[3] < 200
    assert m["actor.batch_full"] == 0.0 and m["actor.sampling_rounds"] == 4.0
    # ... and without a history, at a rate of 1 every later round asks for the cap
    _, m, _ = run_step(make_loop(span, DropRate(), cap=200), p.ops, [20, 200, 200, 200])
    assert m["actor.round_prompts"] == [20, 200, 200, 200]


def test_a_nearly_settled_step_fills_where_rounds_of_the_first_size_cannot(one_rank):
    p = compile_program(dapo_plan(("actor",)), round_group_size=G)
    span = p.rounds
    # 19 of 20 constant in the first round: 15 missing at a rate of 0.95 -> a round of
    # the cap (240: 8 first rounds) keeps them where three more rounds of 20 keep ~3
    loop = make_loop(span, DropRate(), cap=240)
    _, m, _ = run_step(loop, p.ops, [19, 225, 0, 0])
    assert m["actor.round_prompts"] == [20, 240] and m["actor.batch_full"] == 1.0


def test_a_step_of_one_round_reports_the_historys_rate_as_seen(one_rank):
    p = compile_program(dapo_plan(("actor",)), round_group_size=G)
    span = p.rounds
    # the first step of a run: no history, no later round -> 0
    history = DropRate()
    _, m, _ = run_step(make_loop(span, history, cap=200), p.ops, [4, 0, 0, 0])
    assert m["actor.round_prompts"] == [20] and m["actor.dropped_frac_seen"] == 0.0
    # a later step of one round: the decayed history's rate (4 of 20), not this step's
    _, m, _ = run_step(make_loop(span, history, cap=200), p.ops, [0, 0, 0, 0])
    assert m["actor.round_prompts"] == [20]
    assert m["actor.dropped_frac_seen"] == pytest.approx(4 / 20)
    assert m["actor.dropped_group_frac"] == 0.0


@pytest.mark.parametrize("planned,mb,dp,rows,kind,want", [
    (120, 1, 2, 480, "generate", 4),      # 4x the rows: 4 waves of the plan's size
    (120, 1, 2, 40, "generate", 1),       # fewer rows: one smaller wave
    (120, 3, 2, 20, "inference", 1),      # 10 rows a rank, at least ceil(3 * 20 / 120)
    (120, 2, 2, 300, "inference", 5),     # 150 a rank: at least 5, and 5 divides 150
    (120, 2, 2, 280, "inference", 5),     # 140 a rank: at least 4.67 -> 5 divides 140
    (120, 4, 4, 132, "inference", 11),    # 33 a rank: at least 4.4 -> 11 (3 rows each)
])
def test_a_round_call_keeps_the_plans_rows_per_micro_batch_or_fewer(planned, mb, dp, rows,
                                                                    kind, want):
    p = compile_program(dapo_plan(), round_group_size=G)
    op = next(o for o in p.ops if isinstance(o, Call) and o.kind == kind)
    op = round_call(op.__class__(**{**op.__dict__, "micro_batches": mb,
                                    "mfc": op.mfc.model_copy(update={"n_seqs": planned})}),
                    rows, dp)
    assert op.micro_batches == want and op.mfc.n_seqs == rows
    per_rank = rows // dp
    assert -(-per_rank // op.micro_batches) <= planned // (dp * mb)
    if kind == "inference":
        assert per_rank % op.micro_batches == 0


def test_round_quantum_splits_rows_over_every_call():
    assert round_quantum([2, 4], 2) == 2          # the docstring's example
    assert round_quantum([2, 2], 4) == 1
    assert round_quantum([1], 3) == 1
    assert round_quantum([8, 3], 4) == 6          # rows a multiple of 24
    assert DropRate(6, 10).share(9, 10) == pytest.approx(0.75)
    assert DropRate().share(0, 0) == 0.0


@pytest.mark.parametrize("cap,refused", [(1, True), (2, False), (3, False)])
def test_a_round_cap_below_the_quantum_is_refused_when_the_run_is_prepared(tmp_path, cap,
                                                                         refused):
    import copy

    import yaml

    from tests.run.specs import REPO, planned_spec

    raw = yaml.safe_load((REPO / "experiments" / "tiny-dapo-rounds-cpu.yaml").read_text())
    algo = copy.deepcopy(raw["algorithm"])
    # 3 samples a prompt on 2 data-parallel ranks: a round's prompts are a multiple of 2
    algo["samples_per_prompt"] = 3
    algo["params"]["max_round_prompts"] = cap
    spec = planned_spec(tmp_path, "tiny-dapo-rounds-cpu", algorithm=algo)
    if refused:
        with pytest.raises(UserError) as e:
            spec.program()                       # prepare compiles it before any worker
        assert e.value.field == "algorithm.params.max_round_prompts"
        assert "multiple of 2" in e.value.message and "data-parallel" in e.value.message
        return
    program = spec.program()
    quantum = program.round_quantum()
    assert quantum == 2
    # every later round stays within the cap, in multiples of the quantum
    for missing in range(0, 17):
        for f in (0.0, 0.5, 0.97, 1.0):
            n = round_size(missing, f, cap, quantum)
            assert n <= cap and n % quantum == 0


def test_the_plan_prices_the_rounds_at_the_rate_a_recorded_run_dropped(tiny_assets, tmp_path):
    import json

    from planner.graph.sampling_rounds import sized_rounds
    from realign.run.lengths import recorded_drop_frac
    from realign.run.loading import load_experiment
    from realign.run.planning import experiment_graph, resolve_models
    from tests.run.conftest import experiment

    run = tmp_path / "before"
    run.mkdir()
    rows = [{"step": 0, "response_len": 3.0, "actor.dropped_group_frac": 0.2},   # once: 1
            {"step": 1, "response_len": 3.0, "actor.dropped_group_frac": 0.8,
             "actor.round_prompts": [30, 50]},                                   # 80
            {"step": 2, "loss": 1.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    priced = {}
    for label, where in (("configured", None), ("recorded", str(run))):
        exp = experiment(tiny_assets, "tiny-dapo-rounds-cpu", tmp_path / label,
                         models__actor="tiny-llama", plan__lengths_from=where)
        cfg = load_experiment(exp)
        f = recorded_drop_frac(cfg)
        assert f == (None if where is None else pytest.approx((0.2 + 0.8 * 80) / 81))
        gen = next(m for m in experiment_graph(cfg, resolve_models(cfg)).mfcs
                   if m.name == "actor.generate")
        rate = 0.45 if f is None else f
        assert gen.sampling_rounds == pytest.approx(sized_rounds(30, 16, rate, 4, 240)[1] / 30)
        priced[label] = gen.sampling_rounds
    assert priced["recorded"] > 2 * priced["configured"]
