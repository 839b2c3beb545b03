"""The held-out prompt count is derived once (:func:`realign.run.planning.eval_prompts`):
the plan prices the evaluation the run answers, with ``eval.max_prompts`` and without."""
from __future__ import annotations

from pathlib import Path

import pytest

from realign.run.planning import eval_prompts
from realign.run.prepare import prepare
from tests.run.conftest import experiment

pytestmark = pytest.mark.pure

EVAL = {"data": {"path": "tiny/math_eval.jsonl", "kind": "prompts", "max_prompt_len": 8},
        "interval": 2, "samples": 2}


@pytest.mark.parametrize("max_prompts", [None, 3])
def test_the_run_answers_the_prompts_its_plan_prices(tiny_assets, tmp_path, max_prompts):
    ev = {**EVAL, **({"max_prompts": max_prompts} if max_prompts else {})}
    spec = prepare(experiment(tiny_assets, "tiny-grpo-cpu", tmp_path, eval=ev),
                   run_dir=str(tmp_path / "run"))
    assert spec.config.eval is not None
    held = Path(spec.config.eval.data.path)
    rows = sum(1 for ln in held.read_text().splitlines() if ln.strip())
    want = min(rows, max_prompts or rows)
    assert rows > 3 and spec.eval_prompts == eval_prompts(spec.config) == want
    graph = spec.plan.graph
    assert graph.mfc("actor.eval_greedy").n_seqs == want
    assert graph.mfc("actor.eval_sample").n_seqs == want * EVAL["samples"]
