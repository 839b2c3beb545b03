"""Decode steps replayed as CUDA graphs give what the eager steps give: run with
`pytest -m gpu` on a CUDA machine. A world of one rank, a small random model in fp32
(tokens identical, log-probs within float rounding), in waves and in slots that refill
(their partial steps padded to a bucket), greedy and sampled; and the captures are made
once per shape, not per step."""
from __future__ import annotations

import socket

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = 1e-4
MANY_STOPS = list(range(3, 200, 6))


@pytest.fixture(scope="module")
def shard():
    import torch.distributed as dist

    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from planner.specs.model_spec import ModelSpec
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.model import build_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    dev = init_device("cuda", dtype="fp32")
    spec = ModelSpec(name="capture", n_layers=4, hidden=256, n_heads=8, n_kv_heads=2,
                     ffn_hidden=512, vocab_size=256, max_seq_len=512)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1), Layout())
    yield build_model(spec, "lm", groups, dev, seed=3)
    dist.destroy_process_group()


@pytest.mark.parametrize("waves,refill", [(1, False), (2, False), (4, True)])
@pytest.mark.parametrize("sampling", [
    {"max_new_tokens": 40, "greedy": True, "stop_token_ids": MANY_STOPS[::4]},
    {"max_new_tokens": 40, "temperature": 0.9, "seed": 3, "stop_token_ids": MANY_STOPS}])
def test_graph_replayed_generation_gives_what_eager_generation_gives(shard, waves, refill,
                                                                     sampling):
    from realign.runtime.engines.refill import decode_refill
    from realign.runtime.engines.waves import decode_waves
    from realign.runtime.sampling import SamplingParams

    prompts = [[(7 * i + j) % 200 + 3 for j in range(1 + i % 9)] for i in range(32)]
    decode = decode_refill if refill else decode_waves
    with torch.inference_mode():
        want = decode(shard, prompts, SamplingParams(**sampling), 0, waves, 0, None)
        got = decode(shard, prompts, SamplingParams(**sampling), 0, waves, 0, "graph")
    assert torch.equal(want.tokens, got.tokens) and torch.equal(want.lengths, got.lengths)
    assert want.decode_steps == got.decode_steps
    assert (want.logprobs - got.logprobs).abs().max().item() < TOL


def test_one_capture_per_shape(shard):
    from realign.runtime.engines.captured_step import capture_steps, span_bucket
    from realign.runtime.engines.decoder import StageDecoder

    rows, plen, n = 8, 10, 60
    dev = shard.device.device
    tokens = torch.randint(3, 200, (rows, plen), device=dev,
                           generator=torch.Generator(device=dev).manual_seed(0))
    lengths = torch.full((rows,), plen, device=dev)
    with torch.inference_mode():
        with torch.inference_mode(False):
            eager = StageDecoder(shard, plen + n, cache_rows=rows)
            graph = capture_steps(StageDecoder(shard, plen + n, cache_rows=rows), "graph")
        x = eager.prefill(tokens, lengths).argmax(-1, keepdim=True)
        graph.prefill(tokens, lengths)
        pos, spans, diff = lengths.clone(), set(), 0.0
        for t in range(n - 1):
            a, b = eager.step(x, pos, plen + t + 1), graph.step(x, pos, plen + t + 1)
            diff = max(diff, (a - b).abs().max().item())
            spans.add(span_bucket(plen + t + 1, graph.cache_keys))
            x, pos = a.argmax(-1, keepdim=True), pos + 1
    assert graph.replay is not None and len(graph.replay.captures) == len(spans) < n // 10
    assert diff < TOL
