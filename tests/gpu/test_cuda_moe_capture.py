"""A mixture of experts' decode steps replayed as CUDA graphs give what the eager steps
give: run with `pytest -m gpu` on a CUDA machine. The sparse layers' experts run at
decode shapes without reading the routing on the host (realign.runtime.moe_experts), so
a step captures like a dense one. A world of one rank, a small random Qwen3-MoE in fp32
(16 experts, top 4): tokens identical, log-probs within float rounding, in waves and in
slots that refill; and the step reads nothing on the host (a capture would fail)."""
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
    from planner.specs.model_spec import ModelSpec, MoeSpec
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.model import build_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    dev = init_device("cuda", dtype="fp32")
    spec = ModelSpec(name="moe-capture", family="qwen3_moe", n_layers=4, hidden=256, n_heads=8,
                     n_kv_heads=2, ffn_hidden=512, vocab_size=256, max_seq_len=512,
                     qk_norm=True, moe=MoeSpec(n_experts=16, top_k=4, expert_ffn_hidden=128,
                                               norm_topk_prob=True, dense_layers=(1,)))
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1), Layout())
    yield build_model(spec, "lm", groups, dev, seed=3)
    dist.destroy_process_group()


@pytest.mark.parametrize("waves,refill", [(1, False), (4, True)])
@pytest.mark.parametrize("sampling", [
    {"max_new_tokens": 40, "greedy": True, "stop_token_ids": MANY_STOPS[::4]},
    {"max_new_tokens": 40, "temperature": 0.9, "seed": 3, "stop_token_ids": MANY_STOPS}])
def test_graph_replayed_moe_generation_gives_what_eager_generation_gives(shard, waves, refill,
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


def test_a_moe_decode_step_does_not_synchronise(shard):
    """With CUDA's sync debug mode set to error, a host synchronisation raises."""
    from realign.runtime.engines.decoder import StageDecoder

    rows, plen = 8, 10
    dev = shard.device.device
    tokens = torch.randint(3, 200, (rows, plen), device=dev,
                           generator=torch.Generator(device=dev).manual_seed(0))
    lengths = torch.full((rows,), plen, device=dev)
    with torch.inference_mode():
        with torch.inference_mode(False):
            dec = StageDecoder(shard, plen + 4, cache_rows=rows)
        x = dec.prefill(tokens, lengths).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = dec.eager_step(x, lengths.clone(), 16, None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out.shape[0] == rows and torch.isfinite(out).all()
