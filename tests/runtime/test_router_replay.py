"""Rollout routing replay's pieces without an engine: vLLM's captured router calls
turned into each request's experts per position and layer, the replayed top-k (the
rollout's experts, the training router's weights), and the mismatch share."""
from __future__ import annotations

import pytest
import torch

from realign.runtime.engines.vllm_routing import (
    external_id,
    records_routing,
    routing_by_request,
    routing_tensor,
    vllm_eager,
)
from realign.runtime.moe import replayed_top_k
from realign.runtime.router_replay import routing_mismatch

pytestmark = pytest.mark.torch


def test_calls_become_each_requests_experts_by_position_and_layer():
    # step 1: request a's prompt (positions 0, 1) and b's (position 0) in one batch;
    # step 2: a decode step of b alone. Two MoE layers, vLLM ids 0 and 2.
    calls = []
    for layer, shift in ((0, 0), (2, 10)):
        calls.append((layer, ["a-1f", "b-2e"], [0, 2, 3], [0, 1, 0],
                      [[1 + shift, 2 + shift], [3 + shift, 4 + shift], [5 + shift, 6 + shift]]))
        calls.append((layer, ["b-2e"], [0, 1], [1], [[7 + shift, 0 + shift]]))
    got = routing_by_request(calls, [0, 2])
    assert got == {"a": {0: [[1, 2], [11, 12]], 1: [[3, 4], [13, 14]]},
                   "b": {0: [[5, 6], [15, 16]], 1: [[7, 0], [17, 10]]}}
    t = routing_tensor(got["b"], 3, 2, 2)
    assert t.tolist() == [[[5, 6], [15, 16]], [[7, 0], [17, 10]], [[-1, -1], [-1, -1]]]
    assert external_id("12-9d446ee4") == "12" and external_id("a-b-c") == "a-b"


def test_routing_is_recorded_only_where_vllm_runs_eagerly():
    # the capture function is Python inside vLLM's forward: CUDA graphs would skip it
    assert vllm_eager("cpu") and not vllm_eager("cuda")
    assert records_routing(2, vllm_eager("cpu"))
    assert not records_routing(2, vllm_eager("cuda"))
    assert not records_routing(0, vllm_eager("cpu"))


def test_a_position_missing_a_layer_is_left_out():
    calls = [(0, ["a-1"], [0, 2], [0, 1], [[1, 2], [3, 4]]),
             (2, ["a-1"], [0, 1], [0], [[5, 6]])]
    assert routing_by_request(calls, [0, 2]) == {"a": {0: [[1, 2], [5, 6]]}}


def test_replay_uses_the_given_experts_with_the_routers_weights():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    w, e = replayed_top_k(probs, torch.tensor([[2, 1], [-1, -1]]), 2, True)
    assert e.tolist() == [[2, 1], [1, 2]]           # the second row: its own top-2
    assert torch.allclose(w, torch.tensor([[0.4, 0.6], [2 / 3, 1 / 3]]))
    w, _ = replayed_top_k(probs, torch.tensor([[2, 1], [0, 1]]), 2, False)
    assert torch.allclose(w, torch.tensor([[0.2, 0.3], [0.1, 0.6]]))


def test_mismatch_counts_tokens_whose_set_differs_at_some_layer():
    rollout = torch.tensor([[[1, 2], [3, 4]], [[5, 6], [0, 1]], [[-1, -1], [-1, -1]]])
    training = torch.tensor([[[2, 1], [4, 3]], [[5, 6], [0, 2]], [[7, 6], [5, 4]]])
    assert routing_mismatch(rollout, training) == (1, 2)
    assert routing_mismatch(rollout[None], training[None]) == (1, 2)
