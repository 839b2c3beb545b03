"""Rollout routing replay (R3) in a GRPO run of the tiny Qwen3-MoE generating on vLLM, in
bf16 (where vLLM's kernels and realign's forward round differently, so some tokens'
experts differ between them): with ``rollout.routing_replay`` on, vLLM's experts travel
with the rollout to the actor's scoring and train calls, every scored token carries them
(``actor.moe.replayed_frac`` 1, prompt tokens included), the train call's forward routes
exactly as vLLM did (``actor.moe.replay_mismatch`` 0), and the gap between vLLM's
log-probs and the training forward's recomputation (``actor.rollout_logprob_diff_mean``)
is smaller than with replay off, on the same first rollout."""
from __future__ import annotations

import pytest

#: slow: two runs of the mixture of experts in bf16, the tier's longest test, handed
#: out first (tests/conftest.py) so that no pytest worker is left alone with it at the end
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(tiny_assets, tmp_path, replay: str) -> list[dict]:
    from realign.assets.tiny_cmd import make_moe_actor
    from realign.cli.main import main
    from tests.run.conftest import experiment
    from tests.run.run_records import metrics

    if not (tiny_assets / "tiny" / "moe_actor").is_dir():
        make_moe_actor(tiny_assets / "tiny")
    out = tmp_path / f"replay-{replay}"
    out.mkdir()
    exp = experiment(tiny_assets, "tiny-grpo-vllm-cpu", out, run__steps=1, dtype="bf16",
                     models__actor="tiny/moe_actor", rollout__routing_replay=replay)
    assert main(["run", str(exp), "--run-dir", str(out / "run")]) == 0
    return metrics(out / "run")


def test_replay_routes_the_train_call_as_vllm_did(tiny_assets, tmp_path):
    (on,) = _run(tiny_assets, tmp_path, "on")
    (off,) = _run(tiny_assets, tmp_path, "off")
    # the same first rollout (same weights, same sampling seeds)
    assert on["moe.routing_mismatch"] == off["moe.routing_mismatch"]
    assert on["moe.routing_mismatch"] > 0, "bf16: some tokens route differently"
    assert on["actor.moe.replayed_frac"] == 1.0
    assert on["actor.moe.replay_mismatch"] == 0.0
    assert "actor.moe.replayed_frac" not in off and "actor.moe.replay_mismatch" not in off
    print("rollout_logprob_diff_mean on", on["actor.rollout_logprob_diff_mean"],
          "off", off["actor.rollout_logprob_diff_mean"], "max on",
          on["actor.rollout_logprob_diff_max"], "off", off["actor.rollout_logprob_diff_max"],
          "routing_mismatch", on["moe.routing_mismatch"])
    assert on["actor.rollout_logprob_diff_mean"] < off["actor.rollout_logprob_diff_mean"]
