"""Streaming generation (realign.runtime.engines.stream_decode) driven by the stream's
schedule (planner.graph.streaming, its online form): without new weights its tokens are
those of the ordinary refilling generation, greedy and sampled, also when the schedule's
updates make it recompute the cache of the sequences in flight (the same weights), and
each token carries the version the schedule was at when it was made."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cpu_dist

PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12], [150, 1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67]]
STOPS = list(range(3, 200, 6))


def case_stream_vs_refill(ctx, path, sampling, prompts, group_size, slots, recompute):
    """(refill's tokens, streamed tokens, streamed versions, updates applied) on rank 0."""
    from cases_model import replica

    from planner.graph.streaming import StreamSchedule, StreamSettings
    from realign.runtime.engines.refill import decode_refill
    from realign.runtime.engines.stream_decode import StreamDecoder, StreamedSample
    from realign.runtime.sampling import SamplingParams

    shard = replica(ctx, path, "lm", 1, 1, 1)
    if shard is None:
        return None
    p = SamplingParams(**sampling)
    with torch.inference_mode():
        ref = decode_refill(shard, prompts, p, 0, 3, 0)
    want = [ref.tokens[i, :int(ref.lengths[i])].tolist() for i in range(len(prompts))]
    settings = StreamSettings(group_size=group_size, batch_groups=2, slots=slots,
                              train_iters=3, update_iters=1, max_staleness=2,
                              on_update="continue")
    sch = StreamSchedule(settings, [p.max_new_tokens] * len(prompts), keep_segments=True)
    dec = StreamDecoder(shard, slots, max(len(q) for q in prompts), p)
    done: dict[int, StreamedSample] = {}
    applied = 0
    while len(done) < len(prompts):
        it = sch.begin_iteration()
        if it.applied_update:
            applied += 1
            if recompute:
                dec.recompute()
        for i in it.admitted:
            dec.admit(StreamedSample(i, prompts[i]))
        if it.decodes:
            ended = dec.iterate(sch.gen_version)
            done.update({q.sample: q for q in ended})
            sch.end_iteration({q.sample for q in ended})
        sch.take_iteration()
    got = [done[i].tokens for i in range(len(prompts))]
    versions = [done[i].versions for i in range(len(prompts))]
    segments = [[v for v, n in sch.segments[i] for _ in range(n)] for i in range(len(prompts))]
    return want, got, versions, segments, applied


@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "recompute"])
@pytest.mark.parametrize("sampling", [
    {"max_new_tokens": 12, "greedy": True, "stop_token_ids": STOPS[::4]},
    {"max_new_tokens": 12, "temperature": 0.9, "seed": 3, "stop_token_ids": STOPS}],
    ids=["greedy", "sampled"])
def test_streamed_tokens_equal_the_refilling_generation(world2, tiny_models, sampling,
                                                        recompute):
    prompts = [PROMPTS[i % 4][: 1 + i % 5] + [i + 3] for i in range(16)]
    res = [r for r in world2.run("test_stream_decode:case_stream_vs_refill",
                                 tiny_models["llama"], sampling, prompts, 2, 5, recompute)
           if r is not None]
    assert len(res) == 1
    want, got, versions, segments, applied = res[0]
    assert got == want
    # the schedule's updates arrived while sequences were in flight: tokens of a
    # sample carry more than one version, each the one it was made under
    assert applied >= 2
    assert versions == segments
    assert any(len(set(v)) > 1 for v in versions)
