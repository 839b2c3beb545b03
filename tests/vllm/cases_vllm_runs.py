"""What the run tests of the vllm tier share (``test_vllm_workloads.py``,
``test_vllm_algorithms.py``): a short ``realign run`` whose every step is logged with
finite numbers, the generate calls' engines in its plan, and the check that the train
call scored vLLM's rollout as the training forward does."""
from __future__ import annotations

import json
import math

from safetensors.torch import load_file

from tests.run.conftest import experiment
from tests.run.run_records import metrics

SMALL = "tiny/small_actor"
VLLM = {"engine": "vllm", "vllm": {"kv_cache_gib": 1, "max_num_seqs": 256}}


def run(assets, tmp, name, steps=2, **changes):
    """``realign run`` of experiments/<name>.yaml with ``changes``: (plan, metric rows)."""
    from realign.cli.main import main

    exp = experiment(assets, name, tmp, run__steps=steps, **changes)
    assert main(["run", str(exp), "--run-dir", str(tmp / "run")]) == 0
    plan = json.loads((tmp / "run" / "plan.json").read_text())
    rows = metrics(tmp / "run")
    assert [row["step"] for row in rows] == list(range(steps))
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    return plan, rows


def engines(plan) -> dict[str, str]:
    return {a["mfc"]: a["engine"] for a in plan["allocations"] if a["kind"] == "generate"}


def small_actor_bytes(assets) -> int:
    actor = load_file(str(assets / "tiny" / "small_actor" / "model.safetensors"))
    return 4 * sum(t.numel() for t in actor.values())


def scored_against_vllm(row) -> None:
    """The train call scored vLLM's rollout with the training forward: fp32 rounding."""
    assert row["actor.rollout_logprob_diff_max"] < 1e-4
    assert row["actor.rollout_logprob_diff_frac"] == 0.0
