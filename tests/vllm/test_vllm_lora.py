"""A LoRA actor on vLLM (``realign.runtime.engines.vllm_lora``): vLLM's own LoRA, fed
the replica's adapters in memory under a new id per load, its base the checkpoint it
started from. Greedy tokens and log-probs equal realign's own engine's with the same
adapters (TP 1 in this process, TP 2 over two gloo ranks); after the adapters change
(a training step) the next generate follows them and only the adapters moved; a real
2-step GRPO run with LoRA and ``rollout.engine: vllm``."""
from __future__ import annotations

import json

import pytest
import torch

from tests.vllm.cases_vllm_lora import LORA, PROMPTS, N, adapter_bytes, lora_replica, step_adapters
from tests.vllm.cases_vllm_tp import spawn

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from realign.assets.tiny import SMALL_LLAMA, make_model

    return make_model(tmp_path_factory.mktemp("vllm_lora") / "small", "llama", "lm", seed=3,
                      arch=dict(SMALL_LLAMA, max_position_embeddings=64))


@pytest.fixture(scope="module")
def shard(world, model_dir):
    return lora_replica(str(model_dir), 1)


@pytest.fixture(scope="module")
def engine(world, model_dir):
    from realign.runtime.engines.vllm_engine import VLLMEngine
    from realign.runtime.settings import VLLMSettings

    e = VLLMEngine(model_dir, VLLMSettings(kv_cache_gib=0.25, max_num_seqs=64), torch.float32,
                   max_model_len=64, lora=LORA)
    yield e
    e.close()


def own(shard, p):
    from realign.runtime.engines.generate import GenerateEngine

    return GenerateEngine(shard, pad_id=0).generate(PROMPTS, p)


def test_adapter_in_memory_gives_the_own_engines_tokens(shard, engine):
    from realign.runtime.lora import adapters_disabled
    from realign.runtime.settings import SamplingParams

    p = SamplingParams(max_new_tokens=N, greedy=True)
    assert engine.load(shard) == adapter_bytes(shard)
    v, o = engine.generate(shard, PROMPTS, p, pad_id=0), own(shard, p)
    assert v.tokens.tolist() == o.tokens.tolist()
    assert float((v.logprobs - o.logprobs).abs().max()) < 1e-5
    with adapters_disabled(shard):
        base = own(shard, p)
    assert base.tokens.tolist() != o.tokens.tolist()       # the adapters matter


def test_a_training_step_reaches_the_next_generate_and_only_adapters_move(shard, engine):
    from realign.runtime.settings import SamplingParams

    p = SamplingParams(max_new_tokens=N, greedy=True)
    first = engine.load(shard)
    before = engine.generate(shard, PROMPTS, p, pad_id=0)
    step_adapters(shard)
    assert engine.load(shard) == first == adapter_bytes(shard)
    after, mine = engine.generate(shard, PROMPTS, p, pad_id=0), own(shard, p)
    assert after.tokens.tolist() == mine.tokens.tolist() != before.tokens.tolist()
    assert float((after.logprobs - mine.logprobs).abs().max()) < 1e-5
    # the base was never sent: no weight transport was made, and vLLM's worker holds
    # only the adapter of the last load, under its own id
    assert engine.transport is None
    assert engine.llm.collective_rpc("realign_lora_ids") == [[engine.adapters.lora_id]]


def test_tp2_adapter_gives_the_own_engines_tokens(model_dir, tmp_path):
    from tests.vllm.cases_vllm_lora import tp2_lora

    spawn(tp2_lora, 2, str(model_dir), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["hosts"] for r in ranks] == [True, False]
    for r in ranks:
        assert r["bytes"] == ranks[0]["bytes"] > 0
        assert r["tokens"] == r["own"] != r["base"]
        assert r["stepped"] == r["own_stepped"] != r["tokens"]
        assert r["logprob_diff"] < 1e-5
    assert ranks[0]["transport_made"] is False


@pytest.mark.slow
def test_grpo_with_a_lora_actor_on_vllm(tiny_assets, tmp_path):
    from planner.cost.lora_terms import adapter_params
    from planner.specs.layout import Layout
    from realign.cli.main import main
    from realign.runtime.hf_checkpoint import spec_from_hf
    from tests.run.conftest import experiment
    from tests.run.run_records import metrics

    lora = {"rank": 8, "alpha": 16, "target_modules": ["all-linear"]}
    exp = experiment(tiny_assets, "tiny-grpo-vllm-cpu", tmp_path, run__steps=2,
                     models__actor="tiny/small_actor", lora={"actor": lora})
    assert main(["run", str(exp), "--run-dir", str(tmp_path / "run")]) == 0
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    rows = metrics(tmp_path / "run")
    assert [a["engine"] for a in plan["allocations"] if a["kind"] == "generate"] == ["vllm"]
    assert [row["step"] for row in rows] == [0, 1]
    from planner.specs.lora import LoraSpec

    spec = spec_from_hf(tiny_assets / "tiny" / "small_actor")
    adapters = 4 * adapter_params(spec, "lm", Layout(tp=1, pp=1, dp=1), LoraSpec(**lora))
    for row in rows:
        # only the adapters (fp32) into vLLM before each call, never the base
        assert row["vllm_load_bytes.actor.generate"] == adapters
        assert row["actor.rollout_logprob_diff_max"] < 1e-4
        assert row["actor.rollout_logprob_diff_frac"] == 0.0
        assert 0.0 <= row["reward_mean"] <= 1.0
    adapter = tmp_path / "run" / "final" / "actor" / "adapter_model.safetensors"
    assert adapter.exists()
