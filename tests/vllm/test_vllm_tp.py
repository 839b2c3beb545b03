"""vLLM at the plan's layout: a TP 2 engine (hosted by TP rank 0 of a TP 2 realign
replica, its two CPU workers bound one per core) fed the replica's weights in memory
through shared memory. Greedy tokens equal a TP 1 vLLM engine's and transformers'; a
weight change reaches it (its tokens then equal realign's own engine's at TP 2 on the
changed weights) and restoring the weights restores its tokens."""
from __future__ import annotations

import json

import pytest
import torch

from tests.vllm.cases_vllm_tp import PROMPTS, N, spawn, tp_parity

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from realign.assets.tiny import SMALL_LLAMA, make_model

    return make_model(tmp_path_factory.mktemp("vllm_tp") / "small", "llama", "lm", seed=3,
                      arch=dict(SMALL_LLAMA, max_position_embeddings=64))


def test_tp2_engine_fed_in_memory_matches_tp1_and_transformers(model_dir, tmp_path):
    import transformers

    from realign.runtime.engines.vllm_engine import VLLMEngine
    from realign.runtime.settings import SamplingParams, VLLMSettings

    spawn(tp_parity, 2, str(model_dir), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["hosts"] for r in ranks] == [True, False]      # TP rank 0 hosts the engine
    for r in ranks:                                          # both ranks get the records
        assert r["before"] == ranks[0]["before"]
        assert r["bytes"] == ranks[0]["bytes"] > 0
    tp2 = ranks[0]
    assert tp2["changed"] == tp2["own_changed"] != tp2["before"]
    assert tp2["changed_logprob_diff"] < 1e-4
    assert tp2["restored"] == tp2["before"]
    # TP 1: vLLM from the checkpoint, in this process (a one-worker engine)
    engine = VLLMEngine(model_dir, VLLMSettings(kv_cache_gib=0.25, max_num_seqs=64),
                        torch.float32, max_model_len=64)
    try:
        outs = engine._generate(PROMPTS, SamplingParams(max_new_tokens=N, greedy=True), 0, 0)
    finally:
        engine.close()
    assert outs[:, :N].long().tolist() == tp2["before"]
    assert torch.allclose(outs[:, N:2 * N].float(), torch.tensor(tp2["before_logprobs"]),
                          atol=1e-4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == tp2["before"][i]
