"""`realign profile` end to end on this machine, its table read back by `realign plan
--profile` (every rate marked as the profile's), and its bad arguments."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from planner.cost.profile import PROFILE_SCHEMA_VERSION, ProfileTable
from realign.cli.main import main
from tests.run.conftest import experiment

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cpu_dist
@pytest.mark.slow
def test_profile_measures_every_term_and_plan_prices_with_it(tmp_path, capsys, tiny_assets):
    out = tmp_path / "profile.json"
    assert main(["profile", "--out", str(out), "--workers", "2", "--passes", "2"]) == 0
    text = capsys.readouterr().out
    assert f"written to {out}" in text and "the machine's speed over the 2 passes" in text
    t = ProfileTable.load(out)
    assert t.schema_version == PROFILE_SCHEMA_VERSION and t.device == "cpu"
    assert t.measured.workers == 2 and t.measured.dtype == "fp32"
    assert set(t.engines) == {"train", "inference", "prefill", "decode"}
    assert t.gemm is not None and min(min(r) for r in t.gemm.forward_flops_per_s) > 0
    assert t.mem_bytes_per_s > 0 and t.realloc is not None and t.send is not None
    ops = {(c.op, c.group_size) for c in t.collectives}
    assert {("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 2), ("broadcast", 2),
            ("all_to_all", 2), ("p2p", 2)} <= ops
    # the recorded RMS is that of the recorded probes against their fit. How close the
    # fit comes on this machine is a measurement of the machine (benchmarks/profile's
    # tables record it, 9-23 %), not asserted here; that the fit recovers known fixed
    # costs is tests/run/test_profile_fit_cpu.py's
    rel = {}
    for p in t.measured.probes:
        rel.setdefault(p.engine, []).append((p.fitted_s - p.measured_s) / p.measured_s)
    assert set(rel) == set(t.measured.fit_rms_relative_error) == {"inference", "train", "generate"}
    for engine, errors in rel.items():
        rms = math.sqrt(sum(e * e for e in errors) / len(errors))
        assert t.measured.fit_rms_relative_error[engine] == pytest.approx(rms, rel=1e-6)
    assert all(p.measured_s > 0 and math.isfinite(p.fitted_s) for p in t.measured.probes)
    assert len(t.measured.probes) > 100
    # measured in passes, each probe's samples pooled over them (each pass's speed
    # against the pooled one is the machine's: benchmarks/profile records it)
    assert t.measured.passes == 2 and len(t.measured.pass_time_ratios) == 2
    assert all(math.isfinite(r) and r > 0 for r in t.measured.pass_time_ratios)
    # realign's own step cost, from real runs on 1 and 2 workers
    assert t.step is not None and [n for n, _ in t.step.points] == [1.0, 2.0]
    # (a few ms a step; the bound only catches a unit or a span gone wrong)
    assert all(0 <= s < 0.5 for _, s in t.step.points) and t.step.time_s(2) > 0
    plan_out = tmp_path / "plan.json"
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path)
    assert main(["plan", str(exp), "--profile", str(out), "--out", str(plan_out)]) == 0
    text = capsys.readouterr().out
    assert "rates: * from profile" in text
    plan = json.loads(plan_out.read_text())
    assert plan["profile"]["path"] == str(out) and plan["profile"]["dtype"] == "fp32"
    src = plan["cost_sources"]
    # one node measured: everything but collectives across nodes is the profile's, and
    # the host link (the cpu device has none of its own: the preset's, never priced)
    assert t.host_link_bytes_per_s is None
    assert {k for k, v in src.items() if v != "profile"} == {
        k for k in src if k.endswith("across nodes")} | {"host link"}
    assert src["gemm"] == src["engine decode"] == src["all_reduce within a node"] == "profile"
    assert src["all_to_all within a node"] == "profile"
    assert src["step overhead"] == "profile"
    # the host work between steps and the reward function, timed while planning
    assert plan["step_overhead_s"] > t.step.time_s(2) and plan["cost_config"]["batch_s"] > 0
    assert plan["cost_config"]["reward_s_per_seq"] > 0 and "host work:" in text


@pytest.mark.pure
@pytest.mark.parametrize("args,field", [
    (["--workers", "0"], "--workers"),
    (["--threads", "0"], "--threads"),
    (["--passes", "0"], "--passes"),
    (["--preset", "tpu-v9"], "--preset"),
])
def test_bad_arguments_name_the_option(capsys, args, field):
    assert main(["profile", *args]) == 2
    assert field in capsys.readouterr().err


@pytest.mark.pure
def test_plan_refuses_a_profile_of_another_dtype(tmp_path, capsys):
    """(A preset model: the check comes before any model is read.)"""
    t = ProfileTable(device="cpu").model_copy(update={"measured": ProfileTable(
        device="cpu").measured.model_copy(update={"dtype": "bf16"})})
    p = tmp_path / "bf16.json"
    p.write_text(t.model_dump_json())
    exp = tmp_path / "exp.yaml"
    exp.write_text((REPO / "experiments" / "tiny-grpo-cpu.yaml").read_text().replace(
        "tiny/actor", "tiny-llama"))
    assert main(["plan", str(exp), "--profile", str(p)]) == 2
    err = capsys.readouterr().err
    assert "plan.profile" in err and "bf16" in err and "fp32" in err
