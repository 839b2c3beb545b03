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


def test_step_row_averages_the_data_parallel_shares_and_keeps_the_rest():
    from realign.controller.controller import merge_metrics
    reports = [
        {"metrics": {"actor.grad_norm": 2.0, "gen_tokens": 40.0,
                     "realloc_bytes.actor.generate.r0": 10.0,
                     "realloc_bytes.actor.greedy_generate.r0": 1.0},
         "dp_parts": {"loss": 1.0, "actor.loss": 1.0},
         "ops": [[3, "actor.train", "train", [0, 1], "time.actor.train"]],
         "spans": [[3, 100.0, 100.75]]},
        {"metrics": {"realloc_bytes.actor.generate.r1": 6.0},
         "dp_parts": {"loss": 3.0, "actor.loss": 3.0},
         "spans": [[3, 100.25, 100.70]]},       # arrived 0.25 s later: the op starts then
        {"metrics": {}, "dp_parts": {}},       # a rank that reports no share (not last stage)
    ]
    row = merge_metrics(7, reports, wall_s=2.0)
    assert row["step"] == 7 and row["step_time_s"] == 2.0
    assert row["loss"] == row["actor.loss"] == 2.0      # over the two reporting ranks
    assert row["actor.grad_norm"] == 2.0 and row["time.actor.train"] == 0.5
    assert row["realloc_bytes.actor.generate"] == 16.0
    assert row["realloc_bytes.actor.greedy_generate"] == 1.0
    assert row["realloc_bytes"] == 17.0 and row["tokens_per_s"] == 20.0
