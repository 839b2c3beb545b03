"""A mixture of experts' weights as vLLM's engine receives them (without vLLM), on real
gloo ranks, fp32: from a replica at TP2 (every expert split over TP) and at DP2·EP2
(each rank holding half the experts), every rank's engine is handed the checkpoint the
replica was loaded from, bit for bit, every expert under its Hugging Face name."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cpu_dist


class Recorder:
    """A transport that keeps what it is sent."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def begin(self):
        pass

    def send(self, tensors):
        self.tensors.update({n: t.clone() for n, t in tensors})

    def end(self):
        pass

    def close(self):
        pass


def delivered(ctx, path, tp, dp, ep):
    """(tensors the engine of this rank's data-parallel rank receives, the bytes)."""
    from cases_moe_ep import replica_ep

    from realign.runtime.engines.vllm_weights import push_weights

    shard = replica_ep(ctx, path, tp, dp, ep)
    rec = Recorder()
    nbytes = push_weights(shard, rec, bucket_bytes=1)
    return rec.tensors, nbytes


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    return str(make_model(tmp_path_factory.mktemp("vllm_moe_w") / "moe", "qwen3_moe",
                          seed=13, arch=TINY_QWEN3_MOE))


@pytest.mark.parametrize("tp,dp,ep", [(2, 1, 1), (1, 2, 2)])
def test_every_rank_receives_the_checkpoint(world2, moe_path, tp, dp, ep):
    from safetensors.torch import load_file

    want = load_file(f"{moe_path}/model.safetensors")
    assert sum(".mlp.experts." in n for n in want) == 2 * 8 * 3
    for got, nbytes in world2.run("test_vllm_moe_weights:delivered", moe_path, tp, dp, ep):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)
        assert nbytes == sum(t.numel() * 4 for t in want.values())
