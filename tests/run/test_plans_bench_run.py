"""`realign bench plans` end to end on the tiny GRPO: at least 8 distinct plans run,
each MFC's estimate beside its measurement, the record and picture written."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from realign.cli.main import main
from tests.run.conftest import experiment

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cpu_dist
@pytest.mark.slow
def test_bench_plans_runs_eight_distinct_plans(tmp_path, capsys, tiny_assets):
    out, svg = tmp_path / "plans.json", tmp_path / "plans.svg"
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp_path)
    assert main(["bench", "plans", str(exp),
                 "--analytic", "--plans", "8", "--rounds", "1", "--steps", "1",
                 "--warmup", "1", "--out", str(out), "--svg", str(svg)]) == 0
    assert "Kendall tau" in capsys.readouterr().out
    rec = json.loads(out.read_text())
    plans = rec["plans"]
    assert len(plans) == 8 and plans[0]["origin"] == "searched"
    assert len({json.dumps(p["allocations"], sort_keys=True) for p in plans}) == 8
    for p in plans:
        s = p["summary"]
        assert not s["errors"] and s["measured_step"]["n"] == 1
        for m in s["mfcs"]:
            assert m["estimated_s"] > 0 and m["measured"]["median"] > 0
    assert rec["summary"]["mfc_relative_error"]["n"] == sum(len(p["summary"]["mfcs"])
                                                            for p in plans)
    assert rec["summary"]["kendall_tau_iteration"] is not None
    assert rec["config"]["profile"].startswith("none")
    ET.fromstring(svg.read_text())


@pytest.mark.torch
def test_bench_plans_refuses_a_gpu_experiment_this_machine_cannot_run(capsys):
    import torch
    if torch.cuda.device_count() >= 8:
        pytest.skip("this machine has the 8 GPUs the experiment asks for")
    assert main(["bench", "plans", str(REPO / "experiments" / "ppo-llama2-7b-8gpu.yaml"),
                 "--analytic"]) == 2
    err = capsys.readouterr().err
    assert "cluster" in err and "has 8 GPU(s)" in err
