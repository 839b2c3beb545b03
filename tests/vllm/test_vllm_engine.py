"""vLLM's engine (``realign.runtime.engines.vllm_engine``) against realign's own engine
and transformers, in a one-rank gloo world in this process (vLLM's engine core runs in
its child process): greedy tokens identical, log-probs the model's own, weights replaced
in place from a replica, realign's sampling settings and stop tokens honoured."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 17, 40, 3, 42, 7], [1, 11, 12], [1, 50, 1, 2, 3], [1, 60, 61, 62, 63, 64]]
N = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from realign.assets.tiny import SMALL_LLAMA, make_model

    return make_model(tmp_path_factory.mktemp("vllm") / "small", "llama", "lm", seed=3,
                      arch=dict(SMALL_LLAMA, max_position_embeddings=64))


@pytest.fixture(scope="module")
def shard(world, model_dir):
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import load_hf_weights, spec_from_hf
    from realign.runtime.model import build_model

    spec = spec_from_hf(model_dir)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1), Layout(tp=1, pp=1, dp=1))
    s = build_model(spec, "lm", groups, init_device("cpu", dtype="fp32"), init_weights=False)
    load_hf_weights(s, model_dir)
    return s


@pytest.fixture(scope="module")
def engine(world, model_dir):
    from realign.runtime.engines.vllm_engine import VLLMEngine
    from realign.runtime.settings import VLLMSettings

    e = VLLMEngine(model_dir, VLLMSettings(kv_cache_gib=1, max_num_seqs=64), torch.float32,
                   max_model_len=64)
    yield e
    e.close()


def own(shard, p):
    from realign.runtime.engines.generate import GenerateEngine

    return GenerateEngine(shard, pad_id=0).generate(PROMPTS, p)


def test_greedy_tokens_equal_realigns_engine_and_transformers(shard, engine, model_dir):
    import transformers

    from realign.runtime.settings import SamplingParams

    p = SamplingParams(max_new_tokens=N, greedy=True)
    engine.load(shard)
    v, o = engine.generate(shard, PROMPTS, p, pad_id=0), own(shard, p)
    assert v.tokens.tolist() == o.tokens.tolist()
    assert v.lengths.tolist() == [N] * len(PROMPTS)
    assert torch.allclose(v.logprobs, o.logprobs, atol=1e-5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == v.tokens[i].tolist()


def test_weights_are_replaced_in_place_from_the_replica(shard, engine):
    from realign.runtime.settings import SamplingParams

    p = SamplingParams(max_new_tokens=N, greedy=True)
    engine.load(shard)
    before = engine.generate(shard, PROMPTS, p, pad_id=0)
    saved = [prm.detach().clone() for prm in shard.module.parameters()]
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for prm in shard.module.parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=g))
    nbytes = engine.load(shard)
    changed = engine.generate(shard, PROMPTS, p, pad_id=0)
    mine = own(shard, p)
    with torch.no_grad():
        for prm, old in zip(shard.module.parameters(), saved):
            prm.copy_(old)
    assert nbytes > 0
    assert changed.tokens.tolist() == mine.tokens.tolist() != before.tokens.tolist()
    assert torch.allclose(changed.logprobs, mine.logprobs, atol=1e-5)
    engine.load(shard)                           # restored: the same tokens as before
    again = engine.generate(shard, PROMPTS, p, pad_id=0)
    assert again.tokens.tolist() == before.tokens.tolist()
    assert torch.equal(again.logprobs, before.logprobs)


def test_sampling_stops_at_realigns_stop_token_and_scores_the_model_distribution(shard, engine):
    from realign.data.collate import pad_right
    from realign.runtime.engines.inference import InferenceEngine
    from realign.runtime.settings import SamplingParams

    engine.load(shard)
    prompts = PROMPTS * 8
    # the stop token: a token the random model samples often enough
    probe = engine.generate(shard, prompts, SamplingParams(max_new_tokens=N, seed=1), pad_id=0)
    stop = int(torch.mode(probe.tokens[:, :4].flatten()).values)
    p = SamplingParams(max_new_tokens=N, seed=1, temperature=0.8, top_k=40,
                       stop_token_ids=(stop,))
    a = engine.generate(shard, prompts, p, pad_id=0)
    b = engine.generate(shard, prompts, p, pad_id=0)
    assert torch.equal(a.tokens, b.tokens)                     # seeded per sequence
    stopped = 0
    for i in range(len(prompts)):
        n = int(a.lengths[i])
        row = a.tokens[i].tolist()
        assert stop not in row[:n - 1]                         # nothing after a stop token
        if n < N:
            stopped += 1
            assert row[n - 1] == stop and set(row[n:]) == {0}   # kept, then padding
            assert float(a.logprobs[i, n:].abs().sum()) == 0.0
    assert stopped > 0
    # the log-probs are the model's own (temperature 1, no filter): realign's scoring
    tokens, lengths = pad_right([q + a.tokens[i, :int(a.lengths[i])].tolist()
                                 for i, q in enumerate(prompts)], pad_id=0)
    scored = InferenceEngine(shard, micro_batches=1).inference(
        {"tokens": tokens, "lengths": lengths})["logprobs"]
    for i, q in enumerate(prompts):
        n = int(a.lengths[i])
        got = scored[i, len(q) - 1:len(q) - 1 + n]
        assert torch.allclose(got, a.logprobs[i, :n], atol=1e-4)
