"""``realign plan`` shows the calibration's error band for the GPU preset it priced
with, read from the committed summary (``realign bench public --summary``), never
recomputed at plan time; nothing for the cpu device or a plan priced with a profile."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import realign.bench.public as public
from realign.bench.public import DEFAULT_SUMMARY, error_band_line, summary_file
from realign.cli.main import main

pytestmark = pytest.mark.pure

GPU = {"name": "band", "models": {"actor": "qwen2.5-0.5b", "ref": "qwen2.5-0.5b"},
       "algorithm": {"name": "grpo", "prompts_per_step": 8, "samples_per_prompt": 2,
                     "prompt_len": 64, "gen_len": 64, "ppo_minibatches": 1},
       "cluster": {"nodes": 1, "gpus_per_node": 2, "device": "a100-80g"},
       "plan": {"method": "auto", "time_limit_s": 10, "seed": 0}}


def summary(tmp_path: Path) -> Path:
    rec = {"date": "2026-01-02", "summary": {
        "all": {"n_runs": 5, "median_ratio": 0.7, "median_error_pct": 42.9,
                "worst_ratio": 0.2, "worst_error_pct": 400.0},
        "by_device": {"a100-80g": {"n_runs": 3, "median_ratio": 0.8, "median_error_pct": 25.0,
                                   "worst_ratio": 2.5, "worst_error_pct": 150.0}}}}
    p = tmp_path / "summary.json"
    p.write_text(json.dumps(summary_file(rec)))
    return p


def test_line_reads_the_summary(tmp_path):
    p = summary(tmp_path)
    line = error_band_line("a100-80g", p)
    assert line.startswith("GPU presets: median error 43 %, worst 400 % on 5 public runs")
    assert "a100-80g: median error 25 %, worst 150 % on 3" in line
    assert "median 0.80, worst 2.50" in line and "2026-01-02" in line
    assert "none on h200" in error_band_line("h200", p)
    assert error_band_line("cpu", p) is None
    assert "no calibration summary" in error_band_line("h100-80g", tmp_path / "missing.json")


def test_plan_prints_the_band_from_the_file(tmp_path, capsys, monkeypatch):
    p = summary(tmp_path)
    monkeypatch.setattr(public, "DEFAULT_SUMMARY", p)
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(GPU))
    assert main(["plan", str(exp)]) == 0
    out = capsys.readouterr().out
    band = [ln for ln in out.splitlines() if ln.startswith("GPU presets:")]
    assert band == [error_band_line("a100-80g", p)]
    assert out.index("estimated iteration time") < out.index("GPU presets:")
    assert main(["plan", str(exp), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] == band[0]
    # the number follows the file: another summary, another line (nothing recomputed)
    s = json.loads(p.read_text())
    s["all"]["worst_error_pct"] = 123.0
    p.write_text(json.dumps(s))
    assert main(["plan", str(exp)]) == 0
    assert "worst 123 % on 5 public runs" in capsys.readouterr().out


def test_cpu_plan_has_no_band(tmp_path, capsys):
    cfg = json.loads(json.dumps(GPU))
    cfg["models"] = {"actor": "tiny-llama", "ref": "tiny-llama"}
    cfg["cluster"] = {"nodes": 1, "gpus_per_node": 2, "device": "cpu"}
    exp = tmp_path / "cpu.yaml"
    exp.write_text(yaml.safe_dump(cfg))
    assert main(["plan", str(exp), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] is None


def test_committed_summary_is_what_plan_reads():
    s = json.loads(DEFAULT_SUMMARY.read_text())
    line = error_band_line("a100-80g")
    assert f"on {s['all']['n_runs']} public runs" in line
    assert f"median error {s['all']['median_error_pct']:.0f} %" in line
