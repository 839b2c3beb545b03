"""Training with expert parallelism on real gloo ranks, fp32: one replica of the tiny
Qwen3-MoE (8 experts, top 2, the router's load-balancing loss on) trained at DP2·EP2
ends its optimizer steps with the same weights as at DP2·EP1, experts and dense parts
alike (each expert's gradient summed over its expert-data-parallel group, the dense
parameters' over the whole DP group, the gradient norm over every expert once), with the
same loss, router loss and gradient norm; plain and megatron forwards, with and without
the distributed optimizer. Four ranks: TP2·DP2·EP2 against TP2·DP2·EP1."""
from __future__ import annotations

import pytest
import torch

#: relative tolerance on every weight after the steps (fp32; the sums' order differs)
REL = 1e-6
COEF = 0.5


# ---- cases run inside the gloo world -------------------------------------------------

def ep_replica(path, tp, dp, ep):
    """A fresh replica at tp x dp (pp 1), experts over EP groups of ``ep``; None
    off-mesh."""
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import (
        HFReader,
        check_checkpoint,
        load_hf_weights,
        spec_from_hf,
    )
    from realign.runtime.model import build_model

    spec = spec_from_hf(path)
    reader = HFReader(path)
    check_checkpoint(reader, spec, "lm")
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=tp * dp),
                                  Layout(tp=tp, dp=dp, ep=ep))
    if not groups.member:
        return None
    shard = build_model(spec, "lm", groups, init_device("cpu", dtype="fp32"),
                        init_weights=False)
    load_hf_weights(shard, path, reader)
    return shard


def train_ep(ctx, path, tp, dp, ep, forward, zero1, steps=2, micro=2):
    """``steps`` optimizer steps of the token-mean NLL plus the router's loss: (each
    step's metrics, this rank's weights by (tp rank, logical name), its EP rank, the
    largest change of an expert weight and of a router weight)."""
    from cases_model import sample_batch
    from cases_train import sft_loss

    from realign.runtime.engines.train import TrainConfig, TrainEngine
    from realign.runtime.model import logical_shards

    shard = ep_replica(path, tp, dp, ep)
    if shard is None:
        return None
    engine = TrainEngine(shard, TrainConfig(lr=1e-2, clip_grad=0.05, adam_eps=1e-4,
                                            forward=forward, packing=forward == "plain",
                                            distributed_optimizer=zero1),
                         micro_batches=micro)
    g = shard.groups
    before = {n: t.detach().clone()
              for n, t in logical_shards(shard, g.layout, g.pp_rank).items()}
    history = [engine.train_step(sample_batch(n=8, s=12, vocab=shard.spec.vocab_size,
                                              seed=30 + i), sft_loss) for i in range(steps)]
    after = {n: t.detach().clone()
             for n, t in logical_shards(shard, g.layout, g.pp_rank).items()}

    def change(part):
        return max(float((after[n] - before[n]).abs().max()) for n in after if part in n)
    return (history, {(g.tp_rank, n): t for n, t in after.items()}, g.ep_rank,
            change(".local_experts."), change(".mlp.router."))


def budget_refused(ctx, path):
    """The error a train engine with a token budget raises at DP2·EP2: (field, text)."""
    from realign.errors import UserError
    from realign.runtime.engines.train import TrainConfig, TrainEngine

    shard = ep_replica(path, 1, 2, 2)
    try:
        TrainEngine(shard, TrainConfig(lr=1e-3, packing=True, forward="plain"),
                    token_budget=64)
    except UserError as e:
        return e.field, str(e)
    return None, "no error"


# ---- tests ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    arch = dict(TINY_QWEN3_MOE, initializer_range=0.3, router_aux_loss_coef=COEF)
    return str(make_model(tmp_path_factory.mktemp("moe_ep_train") / "moe", "qwen3_moe",
                          seed=11, arch=arch))


def merged(results) -> dict:
    """Every rank's weights in one table; a tensor held by several ranks (data-parallel
    copies) must be equal on all of them."""
    out: dict = {}
    for _, weights, *_ in results:
        for key, t in weights.items():
            if key in out:
                assert torch.equal(out[key], t), key
            out[key] = t
    return out


def assert_same_training(ep1, ep2, n_experts=8):
    w1, w2 = merged(ep1), merged(ep2)
    assert sorted(w1) == sorted(w2)
    experts = [k for k in w2 if ".local_experts." in k[1]]
    assert len({k[1].split(".local_experts.")[1].split(".")[0] for k in experts}) == n_experts
    # each EP rank holds only its half of the experts
    for _, weights, *_ in ep2:
        held = {k[1].split(".local_experts.")[1].split(".")[0] for k in weights
                if ".local_experts." in k[1]}
        assert len(held) == n_experts // 2
    for key, t in w1.items():
        err = float((w2[key] - t).abs().max()) / max(float(t.abs().max()), 1e-12)
        assert err < REL, (key, err)
    for (h1, *_), (h2, *_) in zip(ep1, ep2):
        for m1, m2 in zip(h1, h2):
            for name in ("loss", "router_aux_loss", "grad_norm"):
                assert abs(m1[name] - m2[name]) <= REL * abs(m1[name]) + 1e-7, (name, m1, m2)
            assert m1["update_ok"] == m2["update_ok"] == 1.0
    # the steps moved every rank's experts and router (not a comparison of untouched
    # weights)
    for *_, expert_change, router_change in ep2:
        assert expert_change > 1e-3 and router_change > 1e-3, (expert_change, router_change)


@pytest.mark.cpu_dist
@pytest.mark.parametrize("forward,zero1", [("plain", False), ("megatron", True)])
def test_dp2_ep2_step_equals_dp2_ep1(world2, moe_path, forward, zero1):
    ep1 = world2.run("test_moe_ep_train:train_ep", moe_path, 1, 2, 1, forward, zero1)
    ep2 = world2.run("test_moe_ep_train:train_ep", moe_path, 1, 2, 2, forward, zero1)
    assert [r[2] for r in ep2] == [0, 1]
    assert_same_training(ep1, ep2)


@pytest.mark.cpu_dist
@pytest.mark.slow
def test_tp2_dp2_ep2_step_equals_tp2_dp2_ep1(moe_path):
    from realign.runtime.local_world import LocalWorld

    with LocalWorld(4, timeout_s=300) as w:
        ep1 = w.run("test_moe_ep_train:train_ep", moe_path, 2, 2, 1, "plain", True)
        ep2 = w.run("test_moe_ep_train:train_ep", moe_path, 2, 2, 2, "plain", True)
    assert [r[2] for r in ep2] == [0, 0, 1, 1]
    assert_same_training(ep1, ep2)


@pytest.mark.cpu_dist
def test_a_token_budget_is_refused_at_ep2(world2, moe_path):
    """A budget's bins are each rank's own count, the EP group needs one: refused
    before any step, naming the field."""
    for field, text in world2.run("test_moe_ep_train:budget_refused", moe_path):
        assert field == "plan.token_budget" and "ep 2" in text, text
