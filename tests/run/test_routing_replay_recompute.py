"""rollout.routing_replay against the plan's activation recompute under megatron's
forward (whose recomputed layers rerun after the rollout's experts are unset): ``on``
is refused naming the field, ``auto`` replays nothing; elsewhere the setting stands."""
from __future__ import annotations

import pytest

from planner.specs.model_spec import model_presets
from realign.errors import UserError
from realign.run.loading import load_experiment
from realign.run.vllm_check import replay_with_recompute

pytestmark = pytest.mark.pure

MOE = model_presets()["qwen3-30b-a3b"]


def _cfg(replay: str, forward: str = "megatron"):
    cfg = load_experiment("experiments/grpo-qwen3-30b-a3b-32gpu.yaml")
    return cfg.model_copy(update={
        "device": "cpu",
        "rollout": cfg.rollout.model_copy(update={"routing_replay": replay}),
        "train": cfg.train.model_copy(update={"forward": forward})})


def test_on_with_a_recomputed_actor_train_is_refused_naming_the_field():
    with pytest.raises(UserError) as e:
        replay_with_recompute(_cfg("on"), MOE, True, True)
    assert e.value.field == "rollout.routing_replay" and "recompute" in str(e.value)


def test_auto_with_a_recomputed_actor_train_replays_nothing(capsys):
    cfg = replay_with_recompute(_cfg("auto"), MOE, True, True)
    assert cfg.rollout.routing_replay == "off"
    assert "rollout.routing_replay auto" in capsys.readouterr().err


@pytest.mark.parametrize("replay, forward, recompute", [
    ("on", "megatron", False), ("auto", "megatron", False), ("on", "plain", True),
    ("auto", "plain", True), ("off", "megatron", True)])
def test_replay_stands_without_megatrons_recompute(replay, forward, recompute):
    cfg = _cfg(replay, forward)
    assert replay_with_recompute(cfg, MOE, True, recompute) is cfg
