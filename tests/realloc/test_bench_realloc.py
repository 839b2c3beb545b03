"""The benchmark study end to end on a tiny model (spawns its own 4 ranks)."""
from __future__ import annotations

import json

import pytest

from realign.bench import realloc as bench
from realign.errors import UserError


@pytest.mark.cpu_dist
def test_bench_reports_bytes_at_lower_bound_and_raw_runs(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench.main(["--model", "tiny-llama-8l", "--repeats", "2", "--warmup", "0",
                     "--cases", "tp4->pp4", "g01:tp2->g23:tp2 (disjoint)", "--json",
                     "--out", str(out)])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["environment"]["ranks"] == 4 and printed["config"]["repeats"] == 2
    for row in printed["cases"]:
        assert row["planned"]["bytes_moved"] == row["lower_bound_bytes"] == row["planner_bytes"] > 0
        assert row["naive"]["bytes_moved"] > row["planned"]["bytes_moved"]
        assert row["planned"]["bit_exact"] and row["naive"]["bit_exact"]
        assert len(row["planned"]["runs_s"]) == 2 and len(row["planned"]["per_rank_runs_s"]) == 4


@pytest.mark.pure
def test_bench_rejects_bad_input_before_spawning():
    with pytest.raises(UserError, match="unknown case"):
        bench.main(["--cases", "tp8->tp1"])
    with pytest.raises(UserError, match="tp=4 must divide the 2 KV heads"):
        bench.main(["--model", "tiny-qwen", "--cases", "tp4->pp4"])
