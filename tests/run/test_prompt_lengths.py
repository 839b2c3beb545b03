"""A plan prices the training prompts' lengths read from the data (the runtime pads a
batch only to its longest prompt), the caps when the data is not on this machine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.report import lengths_line, priced_lengths
from realign.errors import UserError
from realign.run.lengths import data_prompt_lengths
from realign.run.loading import load_experiment
from realign.run.planning import experiment_graph, plan_experiment, resolve_models
from tests.run.conftest import REPO, experiment

pytestmark = pytest.mark.pure


def tiny(assets: Path, tmp_path: Path, prompts: list[str] | None):
    """tiny-grpo-cpu beside the tiny assets, with its own training prompts (None: a data
    file that is not there)."""
    cfg = load_experiment(experiment(assets, "tiny-grpo-cpu", tmp_path))
    data = tmp_path / "prompts.jsonl"
    if prompts is not None:
        data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    train = cfg.data.train.model_copy(update={"path": str(data)})
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"train": train})})


def test_the_prompts_lengths_come_from_the_data(tiny_assets, tmp_path):
    cfg = load_experiment(experiment(tiny_assets, "tiny-grpo-cpu", tmp_path))
    lengths = data_prompt_lengths(cfg)
    # every tiny math prompt ("8+1=") is 5 tokens (with the tokenizer's start token)
    assert lengths.max_len == cfg.algorithm.prompt_len == 8
    assert lengths.histogram == ((5, 80.0),)
    graph = experiment_graph(cfg, resolve_models(cfg))
    assert all(m.prompt_lengths == lengths for m in graph.mfcs)
    # a prompt longer than max_prompt_len is the run's error, named
    long_cfg = tiny(tiny_assets, tmp_path, ["1+2=", "1+2+3+4+5+6+7+8+9="])
    with pytest.raises(UserError) as e:
        data_prompt_lengths(long_cfg)
    assert e.value.field.startswith("data.train")


def test_shorter_prompts_price_a_shorter_step(tiny_assets, tmp_path):
    short_cfg = tiny(tiny_assets, tmp_path, ["1="] * 8)
    elsewhere = tmp_path / f"{tmp_path.name}-capped"
    elsewhere.mkdir()
    capped_cfg = tiny(tiny_assets, elsewhere, None)       # no file here: the caps
    assert data_prompt_lengths(capped_cfg) is None
    assert data_prompt_lengths(short_cfg).histogram[-1][0] < 5
    short = plan_experiment(short_cfg)
    capped = plan_experiment(capped_cfg)
    assert short.iteration_time_s < capped.iteration_time_s
    # the plan says what it priced: the prompts' mean, the rows padded to prompt + 4
    n = data_prompt_lengths(short_cfg).histogram[0][0]
    said = priced_lengths(short)
    assert said["prompt_mean"] == n and said["padded_mean"] == pytest.approx(n + 4)
    assert f"prompts {n:.1f} tokens on average (cap 8)" in lengths_line(short)
    assert priced_lengths(capped) is None and lengths_line(capped) is None


def test_a_preset_actor_has_no_tokenizer_here():
    cfg = load_experiment(REPO / "experiments" / "ppo-llama2-7b-8gpu.yaml")
    assert data_prompt_lengths(cfg) is None
