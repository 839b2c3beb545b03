"""Records built from a generation call."""
from __future__ import annotations

import pytest
import torch

from realign.worker.records import sequences_from_generation

pytestmark = pytest.mark.pure


def test_sequences_join_each_prompt_with_its_own_continuation():
    prompts = [[5, 6, 7], [8], [9, 10]]
    gen = torch.tensor([[11, 12, 0], [13, 14, 15], [16, 0, 0]])
    lps = torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5], [-0.6, 0.0, 0.0]])
    lengths = torch.tensor([2, 3, 1])
    seqs, logprobs = sequences_from_generation(prompts, gen, lps, lengths, pad_id=0)
    assert seqs["tokens"].tolist() == [[5, 6, 7, 11, 12], [8, 13, 14, 15, 0], [9, 10, 16, 0, 0]]
    assert seqs["lengths"].tolist() == [5, 4, 3]
    assert seqs["prompt_lengths"].tolist() == [3, 1, 2]
    # position t scores token t+1: a response token at position p is scored at p-1
    assert torch.allclose(logprobs["logprobs"], torch.tensor([
        [0.0, 0.0, -0.1, -0.2], [-0.3, -0.4, -0.5, 0.0], [0.0, -0.6, 0.0, 0.0]]))
