"""A stream's greedy slot (realign.runtime.engines.stream_decode, ``greedy=``: ReMax's
baseline, the last sample of each group): those samples' tokens are the greedy
generation's, the others' the sampled generation's, in the same slots and iterations."""
from __future__ import annotations

import pytest
import torch

from tests.runtime.test_stream_decode import PROMPTS, STOPS

pytestmark = pytest.mark.cpu_dist


def case_greedy_slot(ctx, path, prompts, group_size, slots):
    """(greedy refill's tokens, sampled refill's tokens, streamed tokens) on rank 0."""
    from cases_model import replica

    from planner.graph.streaming import StreamSchedule, StreamSettings
    from realign.runtime.engines.refill import decode_refill
    from realign.runtime.engines.stream_decode import StreamDecoder, StreamedSample
    from realign.runtime.sampling import SamplingParams

    shard = replica(ctx, path, "lm", 1, 1, 1)
    if shard is None:
        return None
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, seed=3, stop_token_ids=STOPS)
    greedy = SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=STOPS)
    out = []
    for p in (greedy, sampled):
        with torch.inference_mode():
            ref = decode_refill(shard, prompts, p, 0, 3, 0)
        out.append([ref.tokens[i, :int(ref.lengths[i])].tolist() for i in range(len(prompts))])
    settings = StreamSettings(group_size=group_size, batch_groups=2, slots=slots,
                              train_iters=3, update_iters=0, max_staleness=2)
    sch = StreamSchedule(settings, [10] * len(prompts))
    dec = StreamDecoder(shard, slots, max(len(q) for q in prompts), sampled,
                        greedy=lambda i: i % group_size == group_size - 1)
    done: dict[int, StreamedSample] = {}
    while len(done) < len(prompts):
        it = sch.begin_iteration()
        for i in it.admitted:
            dec.admit(StreamedSample(i, prompts[i]))
        if it.decodes:
            ended = dec.iterate(sch.gen_version)
            done.update({q.sample: q for q in ended})
            sch.end_iteration({q.sample for q in ended})
        sch.take_iteration()
    out.append([done[i].tokens for i in range(len(prompts))])
    return out


def test_the_greedy_slot_of_each_group_decodes_greedily(world2, tiny_models):
    prompts = [PROMPTS[i % 4][: 1 + i % 5] + [i + 3] for i in range(12)]
    res = [r for r in world2.run("test_stream_greedy_slot:case_greedy_slot",
                                 tiny_models["llama"], prompts, 3, 5) if r is not None]
    assert len(res) == 1
    greedy, sampled, got = res[0]
    for i, tokens in enumerate(got):
        assert tokens == (greedy[i] if i % 3 == 2 else sampled[i]), i
    assert any(greedy[i] != sampled[i] for i in range(len(prompts)))
