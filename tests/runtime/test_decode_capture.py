"""Decode steps captured once per shape and replayed (realign.runtime.engines.captured_step)
give what the eager steps give: greedy and sampled tokens identical, log-probs within
float rounding, in waves and in slots that refill (whose partial steps are padded to a
bucket), at TP1, TP2 and PP2 on CPU. The CPU tests trace the capture (torch.compile's
eager backend: the capture's shapes, buffers and buckets without code generation);
CUDA graphs run in tests/gpu/test_cuda_decode_capture.py."""
from __future__ import annotations

import pytest
import torch

from realign.runtime.engines.captured_step import capture_mode, rows_bucket, span_bucket

#: log-probs of a captured step against the eager one (fp32; the capture attends over
#: more masked keys, which may change the rounding of the softmax's sums)
TOL = 1e-5
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12], [150, 1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67]]
#: stop tokens that end most sampled responses within a few tokens, so slots refill and
#: partial steps run (fewer than half the slots decoding)
MANY_STOPS = list(range(3, 200, 6))


@pytest.mark.pure
def test_buckets_and_modes():
    assert [span_bucket(n, 1024) for n in (1, 16, 17, 40, 200, 256, 257, 300, 1000)] == \
        [16, 16, 32, 64, 256, 256, 512, 512, 1024]
    assert span_bucket(300, 320) == 320 and span_bucket(100, 112) == 112
    assert [rows_bucket(n, 16) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert rows_bucket(9, 12) == 12
    assert capture_mode("auto", "cuda") == "graph" and capture_mode("auto", "cpu") is None
    assert capture_mode("on", "cpu") == "compile" and capture_mode("off", "cuda") is None


# ---- cases, run on every rank of the gloo world ----------------------------------------

def case_decode(ctx, path, tp, pp, dp, sampling, prompts, waves, refill, mode):
    """(tokens, log-probs, lengths, decode steps) of this DP rank's prompts."""
    from cases_model import replica

    from realign.runtime.engines.refill import decode_refill
    from realign.runtime.engines.waves import decode_waves
    from realign.runtime.sampling import SamplingParams

    shard = replica(ctx, path, "lm", tp, pp, dp)
    if shard is None:
        return None
    per = len(prompts) // dp
    first = shard.groups.dp_rank * per
    decode = decode_refill if refill else decode_waves
    with torch.inference_mode():
        res = decode(shard, prompts[first:first + per], SamplingParams(**sampling), first,
                     waves, 0, mode)
    return res.tokens.tolist(), res.logprobs.tolist(), res.lengths.tolist(), res.decode_steps


def case_steps(ctx, path, tp, n_steps):
    """Eager and traced steps of two decoders from the same prefill: (largest logit
    difference, captures made, the key-span buckets the steps crossed)."""
    from cases_model import replica

    from realign.runtime.engines.captured_step import capture_steps
    from realign.runtime.engines.decoder import StageDecoder

    shard = replica(ctx, path, "lm", tp, 1, 1)
    if shard is None:
        return None
    rows, plen = 3, 9
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 200, (rows, plen), generator=g)
    lengths = torch.tensor([plen, 4, 7])
    diff, spans = 0.0, set()
    with torch.inference_mode():
        with torch.inference_mode(False):
            eager = StageDecoder(shard, plen + n_steps, cache_rows=rows)
            traced = capture_steps(StageDecoder(shard, plen + n_steps, cache_rows=rows), "trace")
        x = eager.prefill(tokens, lengths).argmax(-1, keepdim=True)
        traced.prefill(tokens, lengths)
        pos = lengths.clone()
        for t in range(n_steps - 1):
            kv = plen + t + 1
            a, b = eager.step(x, pos, kv), traced.step(x, pos, kv)
            diff = max(diff, float((a - b).abs().max()))
            spans.add(span_bucket(kv, traced.cache_keys))
            x = a.argmax(-1, keepdim=True)
            pos += 1
    assert traced.replay is not None
    return diff, len(traced.replay.captures), len(spans)


# ---- the tests -------------------------------------------------------------------------

@pytest.mark.cpu_dist
def test_traced_steps_equal_eager_steps_and_are_captured_once_per_bucket(world2, tiny_models):
    out = [r for r in world2.run("test_decode_capture:case_steps", tiny_models["llama"], 1, 40)
           if r is not None]
    assert len(out) == 1
    for diff, captures, spans in out:
        assert diff < TOL
        assert captures == spans == 3           # keys 16, 32, 64: 39 steps, 3 captures


@pytest.mark.cpu_dist
@pytest.mark.parametrize("tp,pp,dp,waves,refill", [
    (1, 1, 1, 1, False), (1, 1, 1, 4, True), (2, 1, 1, 3, True), (1, 2, 1, 4, True),
    (1, 1, 2, 2, False)])
@pytest.mark.parametrize("sampling", [
    {"max_new_tokens": 20, "greedy": True, "stop_token_ids": MANY_STOPS[::4]},
    {"max_new_tokens": 20, "temperature": 0.9, "seed": 3, "stop_token_ids": MANY_STOPS}])
def test_captured_generation_gives_what_eager_generation_gives(world2, tiny_models, tp, pp,
                                                               dp, waves, refill, sampling):
    path = tiny_models["llama"]
    prompts = [PROMPTS[i % 4][: 1 + i % 5] + [i + 3] for i in range(16)]
    args = (path, tp, pp, dp, sampling, prompts, waves, refill)
    want = [r for r in world2.run("test_decode_capture:case_decode", *args, None)
            if r is not None]
    got = [r for r in world2.run("test_decode_capture:case_decode", *args, "trace")
           if r is not None]
    assert len(got) == len(want) == tp * pp * dp
    for (t1, lp1, n1, s1), (t2, lp2, n2, s2) in zip(want, got):
        assert t1 == t2 and n1 == n2 and s1 == s2
        assert max(abs(a - b) for r1, r2 in zip(lp1, lp2) for a, b in zip(r1, r2)) < TOL
    if refill and not sampling.get("greedy"):
        lengths = want[0][2]
        assert min(lengths) < 6 and max(lengths) > 2 * min(lengths)   # slots did refill
