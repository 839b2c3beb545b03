"""The streamed slots' sampling noise (realign.runtime.engines.stream_decode._SlotNoise),
made a block of positions per slot at a time: each row is the noise of its own sample at
its own position (realign.runtime.sampling.gumbel_noise_rows), bit for bit, when a
sample crosses its block, when a slot changes hands and when several slots refill at
once."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.torch


def test_slot_noise_is_each_samples_noise_at_its_position(monkeypatch):
    from realign.runtime.engines import stream_decode
    from realign.runtime.sampling import gumbel_noise_rows, position_hashes

    seed, slots, vocab, n = 2 ** 40 + 9, 3, 50, 12
    monkeypatch.setattr(stream_decode, "NOISE_BLOCK", 4 * slots * vocab)    # blocks of 4
    noise = stream_decode._SlotNoise(position_hashes(seed, n), slots, vocab)
    assert noise.width == 4
    # (slot, sample, made) per iteration: samples cross their blocks, slot 1 changes
    # hands mid-block, a sample resumes past its block's end, slot 2 is idle at times
    timeline = [
        [(0, 10, 0), (1, 11, 0)],
        [(0, 10, 1), (1, 11, 1), (2, 2 ** 33 + 5, 0)],
        [(0, 10, 2), (1, 11, 2), (2, 2 ** 33 + 5, 1)],
        [(0, 10, 3), (1, 12, 0), (2, 2 ** 33 + 5, 2)],
        [(0, 10, 4), (1, 12, 1)],
        [(1, 12, 2), (0, 10, 5)],
        [(0, 10, 11), (1, 12, 3), (2, 7, 0)],
    ]
    for it in timeline:
        slot_ids, samples, made = (list(x) for x in zip(*it))
        got = noise.at(slot_ids, samples, made)
        want = gumbel_noise_rows(seed, torch.tensor(samples), made, vocab)
        assert torch.equal(got, want)
