"""The router's load-balancing loss at PP2 (realign.runtime.moe_stages): each stage pools
its own sparse layers, weighted by its share of them, and the train step's logged loss is
the sum over stages; a stage other than the last trains its routers through the term
attached to the activation it sends. A 4-layer tiny Qwen3-MoE whose layer 1 is dense:
stage 0 holds one sparse layer (weight 1/3), stage 1 two (weight 2/3)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cpu_dist

COEF = 0.5


def _engine(ctx, path, lr=1e-3, micro=1):
    from cases_model import replica

    from realign.runtime.engines.train import TrainConfig, TrainEngine

    shard = replica(ctx, path, "lm", 1, 2, 1, fresh=True)
    return shard, TrainEngine(shard, TrainConfig(lr=lr, forward="plain", packing=False,
                                                 clip_grad=0.0), micro_batches=micro)


def stage_sum_matches_transformers(ctx, path):
    """(the step's router_aux_loss, the stage-weighted sum of transformers'
    load_balancing_loss_func over each stage's sparse layers, the pooled one over all) on
    every rank (the last stage's metrics broadcast)."""
    from cases_model import sample_batch
    from cases_train import sft_loss
    from tiny_hf import hf_model
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    shard, engine = _engine(ctx, path)
    spec = shard.spec
    batch = sample_batch(n=4, s=12, vocab=spec.vocab_size, seed=3)
    metrics = engine.train_step(batch, sft_loss)
    valid = torch.arange(12) < batch["lengths"][:, None]
    with torch.no_grad():
        ref = hf_model(path)(batch["tokens"], attention_mask=valid.long(),
                             output_router_logits=True)
    logits = [r for r in ref.router_logits if r is not None]
    sparse = [x for x in range(spec.n_layers) if spec.is_sparse(x)]
    per = spec.n_layers // 2
    want = 0.0
    for stage in range(2):
        mine = [lg for x, lg in zip(sparse, logits) if stage * per <= x < (stage + 1) * per]
        want += len(mine) / len(sparse) * float(load_balancing_loss_func(
            tuple(mine), spec.moe.n_experts, spec.moe.top_k, valid.long()))
    pooled = float(load_balancing_loss_func(tuple(logits), spec.moe.n_experts,
                                            spec.moe.top_k, valid.long()))
    got = metrics.get("router_aux_loss")
    return got, want, pooled


def aux_alone_trains_every_stages_routers(ctx, path):
    """Steps whose task loss is zero: the largest change of this stage's router weights,
    and of its last layer's experts (no router reads their output)."""
    from cases_model import sample_batch

    shard, engine = _engine(ctx, path, lr=0.005, micro=2)
    routers = {n: p.detach().clone() for n, p in shard.module.named_parameters()
               if "mlp.router" in n}
    experts = {n: p.detach().clone() for n, p in shard.module.named_parameters()
               if "layers.1.mlp.experts" in n}
    batch = sample_batch(n=4, s=12, vocab=shard.spec.vocab_size, seed=4)
    for _ in range(2):
        engine.train_step(batch, lambda out, mb: ((out * 0.0).sum(), {}))
    params = dict(shard.module.named_parameters())
    return (shard.groups.pp_rank,
            max(float((params[n] - w).abs().max()) for n, w in routers.items()),
            max((float((params[n] - w).abs().max()) for n, w in experts.items()), default=0.0))


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    root = tmp_path_factory.mktemp("moe_aux_pp")
    return str(make_model(root / "moe", "qwen3_moe", seed=21, arch=dict(
        TINY_QWEN3_MOE, initializer_range=0.3, num_hidden_layers=4, mlp_only_layers=[1],
        router_aux_loss_coef=COEF)))


def test_pp2_logs_the_stage_weighted_sum(world2, moe_path):
    got = world2.run("test_moe_router_loss_pp:stage_sum_matches_transformers", moe_path)
    for aux, want, pooled in got:
        assert aux is not None and abs(aux - want) < 1e-5, (aux, want, pooled)
    assert abs(got[0][1] - got[0][2]) > 1e-6     # the sum is not the pooled loss here


def test_pp2_router_loss_trains_both_stages_routers(world2, moe_path):
    got = sorted(world2.run("test_moe_router_loss_pp:aux_alone_trains_every_stages_routers",
                            moe_path))
    assert [r[0] for r in got] == [0, 1]
    for _stage, router_change, _expert_change in got:
        assert router_change > 1e-3
    # stage 1's layer of local index 1 is the model's last: its experts get no gradient
    assert got[1][2] == 0.0
