"""Generation cases run inside the gloo world."""
from __future__ import annotations

import torch
from cases_model import replica
from tiny_hf import hf_model

from realign.data.collate import pad_right
from realign.runtime.engines.generate import GenerateEngine
from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12], [150, 1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67]]


def generate(ctx, path, tp, pp, dp, sampling: dict, prompts=PROMPTS, waves=1, refill=False):
    shard = replica(ctx, path, "lm", tp, pp, dp)
    if shard is None:
        return None
    out = GenerateEngine(shard).generate(prompts, SamplingParams(**sampling), waves=waves,
                                         refill=refill)
    return out.tokens.tolist(), out.logprobs.tolist(), out.lengths.tolist()


def kv_cache_peak(ctx, path, tp, pp, dp, n_prompts, prompt_len, n, waves):
    """(peak KV-cache bytes this rank held, its model spec as JSON) when generating for
    ``n_prompts`` prompts of ``prompt_len`` tokens in ``waves`` waves."""
    shard = replica(ctx, path, "lm", tp, pp, dp)
    if shard is None:
        return None
    prompts = [[(7 * i + j) % 150 + 3 for j in range(prompt_len)] for i in range(n_prompts)]
    out = GenerateEngine(shard).generate(prompts, SamplingParams(max_new_tokens=n, seed=5),
                                         waves=waves)
    return out.kv_cache_peak_bytes, shard.spec.model_dump_json()


def hf_greedy(ctx, path, n, prompts=PROMPTS):
    """transformers' own greedy ``generate``, one prompt at a time (no padding)."""
    if ctx.rank != 0:
        return None
    model = hf_model(path)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False)
        out.append(gen[0, len(p):].tolist())
    return out


def joined(prompts, gen):
    """Each prompt followed by its generated tokens, right-padded: (tokens, lengths)."""
    return pad_right([p + gen.tokens[i, :gen.lengths[i]].tolist()
                      for i, p in enumerate(prompts)], pad_id=0)


def logprobs_match_inference(ctx, path, tp, pp, dp):
    """Generated tokens' log-probs equal ``inference`` on prompt + generation."""
    shard = replica(ctx, path, "lm", tp, pp, dp)
    if shard is None:
        return None
    gen = GenerateEngine(shard).generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=3,
                                                                 top_k=50, temperature=0.9))
    tokens, lengths = joined(PROMPTS, gen)
    lp = InferenceEngine(shard).inference({"tokens": tokens, "lengths": lengths})["logprobs"]
    diff = 0.0
    for i, p in enumerate(PROMPTS):
        n = int(gen.lengths[i])
        diff = max(diff, float((lp[i, len(p) - 1:len(p) - 1 + n] - gen.logprobs[i, :n]).abs().max()))
    return diff


def outputs_feed_training(ctx, path, tp, pp, dp, forward):
    """Generation and scoring run in inference mode; what they return (and the RoPE
    tables the decoder and megatron cache meanwhile) must still serve autograd: train
    on the generated sequences with a loss weighted by their scored log-probs."""
    from realign.runtime.engines.train import TrainConfig, TrainEngine

    shard = replica(ctx, path, "lm", tp, pp, dp, fresh=True)
    gen = GenerateEngine(shard).generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=1))
    tokens, lengths = joined(PROMPTS, gen)
    scored = InferenceEngine(shard).inference({"tokens": tokens, "lengths": lengths})
    made = (gen.tokens, gen.logprobs, gen.lengths, scored["logprobs"])
    ordinary = not any(t.is_inference() for t in made)
    weight = scored["logprobs"].sum(1).neg()    # per-row weights from the scoring

    def loss(outputs, mb):
        return -(outputs.sum(1) * mb["weight"]).mean(), {}

    engine = TrainEngine(shard, TrainConfig(lr=1e-3, forward=forward,
                                             packing=forward != "megatron"))
    m = engine.train_step({"tokens": tokens, "lengths": lengths, "weight": weight}, loss)
    return ordinary, m["update_ok"]


def generate_steps(ctx, path, sampling: dict, prompts, waves, refill):
    """(lengths, decode steps) of this rank's share at TP1 PP1 DP1."""
    shard = replica(ctx, path, "lm", 1, 1, 1)
    if shard is None:
        return None
    out = GenerateEngine(shard).generate(prompts, SamplingParams(**sampling), waves=waves,
                                         refill=refill)
    return out.lengths.tolist(), out.decode_steps
