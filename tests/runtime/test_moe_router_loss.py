"""The router's load-balancing loss and the expert load of a mixture of experts (Qwen3-MoE)
in training: the loss equals transformers' ``load_balancing_loss_func`` (on recorded
routings and in a train step of a tiny model, padded, packed and megatron's forward, TP1
and TP2), it is in the actor's loss with the config's coefficient and trains the router;
a short GRPO run logs it and the expert load in metrics.jsonl and the report."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

TOL = 1e-5
#: a large coefficient, so a loss without the router's term would differ by about 1
COEF = 0.5


# ---- cases run inside the gloo world -------------------------------------------------

def _train_engine(ctx, path, tp, forward, packing, micro=1, lr=1e-3):
    from cases_model import replica

    from realign.runtime.engines.train import TrainConfig, TrainEngine

    shard = replica(ctx, path, "lm", tp, 1, 1, fresh=True)
    if shard is None:
        return None, None
    return shard, TrainEngine(shard, TrainConfig(lr=lr, forward=forward, packing=packing,
                                                 clip_grad=0.0), micro_batches=micro)


def step_matches_transformers(ctx, path, tp, forward, packing):
    """One train step of the token-mean NLL (its metrics are the forward's, before the
    update): (realign's router_aux_loss, loss) against transformers' aux_loss and loss
    (labels past each length ignored), which adds router_aux_loss_coef x aux_loss; and
    the expert load's two summaries."""
    from cases_model import sample_batch
    from cases_train import sft_loss
    from tiny_hf import hf_model

    shard, engine = _train_engine(ctx, path, tp, forward, packing)
    if shard is None:
        return None
    batch = sample_batch(n=4, s=12, vocab=shard.spec.vocab_size, seed=3)
    metrics = engine.train_step(batch, sft_loss)
    valid = torch.arange(12) < batch["lengths"][:, None]
    labels = batch["tokens"].masked_fill(~valid, -100)
    with torch.no_grad():
        ref = hf_model(path)(batch["tokens"], attention_mask=valid.long(), labels=labels,
                             output_router_logits=True)
    return (metrics["router_aux_loss"], float(ref.aux_loss), metrics["loss"], float(ref.loss),
            metrics["expert_load_max_over_mean"], metrics["expert_load_max_over_mean_worst"])


def aux_alone_trains_the_router(ctx, path):
    """Steps whose task loss is zero: only the router's loss has a gradient. Returns
    the router_aux_loss of each step, the largest change of any router weight and of
    any expert weight of the last layer (whose output no router reads)."""
    from cases_model import sample_batch

    shard, engine = _train_engine(ctx, path, 1, "plain", True, lr=0.005)
    if shard is None:
        return None
    routers = {n: p.detach().clone() for n, p in shard.module.named_parameters()
               if "mlp.router" in n}
    last = f"layers.{shard.spec.n_layers - 1}.mlp.experts"
    experts = {n: p.detach().clone() for n, p in shard.module.named_parameters()
               if last in n}
    assert experts
    batch = sample_batch(n=4, s=12, vocab=shard.spec.vocab_size, seed=4)
    auxes = [engine.train_step(batch, lambda out, mb: ((out * 0.0).sum(), {}))
             ["router_aux_loss"] for _ in range(4)]
    params = dict(shard.module.named_parameters())
    return (auxes, max(float((params[n] - w).abs().max()) for n, w in routers.items()),
            max(float((params[n] - w).abs().max()) for n, w in experts.items()))


# ---- tests ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    root = tmp_path_factory.mktemp("moe_aux")
    return str(make_model(root / "moe", "qwen3_moe", seed=21, arch=dict(
        TINY_QWEN3_MOE, initializer_range=0.3, router_aux_loss_coef=COEF)))


@pytest.mark.torch
def test_loss_equals_transformers_on_recorded_routings():
    """Random router logits of 3 layers, with and without a padding mask: realign's
    loss equals transformers' load_balancing_loss_func; the worked example's numbers."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from realign.runtime.moe import (
        RouterRecord,
        expert_load,
        load_balancing_loss,
        load_summary,
    )

    g = torch.Generator().manual_seed(0)
    b, s, n_exp, k = 3, 7, 8, 2
    logits = [torch.randn(b * s, n_exp, generator=g) * 2 for _ in range(3)]
    mask = torch.arange(s) < torch.tensor([7, 4, 1])[:, None]
    rec = RouterRecord()
    for lg in logits:
        p = torch.softmax(lg, -1)
        rec.add(p.reshape(b, s, n_exp), torch.topk(p, k, -1).indices.reshape(b, s, k))
    for m in (None, mask):
        ref = load_balancing_loss_func(tuple(logits), n_exp, k, m)
        assert abs(float(load_balancing_loss(rec, m)) - float(ref)) < 1e-6
    counts = expert_load(rec, mask)
    assert counts.shape == (3, n_exp) and (counts.sum(1) == int(mask.sum()) * k).all()

    ex = RouterRecord()
    ex.add(torch.tensor([[0.75, 0.25], [0.5, 0.5]]), torch.tensor([[0], [0]]))
    assert abs(float(load_balancing_loss(ex)) - 1.25) < 1e-7
    assert load_summary(torch.tensor([[6, 2, 0, 0]])) == {
        "expert_load_max_over_mean": 3.0, "expert_load_max_over_mean_worst": 3.0}


@pytest.mark.cpu_dist
@pytest.mark.parametrize("tp,forward,packing", [(1, "plain", True), (1, "plain", False),
                                                (1, "megatron", False), (2, "plain", True)])
def test_train_step_adds_transformers_aux_loss(world2, moe_path, tp, forward, packing):
    got = [r for r in world2.run("test_moe_router_loss:step_matches_transformers", moe_path,
                                 tp, forward, packing) if r is not None]
    assert len(got) == tp
    for aux, ref_aux, loss, ref_loss, load_mean, load_worst in got:
        assert abs(aux - ref_aux) < TOL, (aux, ref_aux)
        assert abs(loss - ref_loss) < TOL, (loss, ref_loss)     # coef x aux inside
        assert 1.0 < load_mean <= load_worst <= 8 / 2           # E / k at worst


@pytest.mark.cpu_dist
def test_router_loss_alone_trains_the_router(world2, moe_path):
    auxes, router_change, expert_change = world2.run(
        "test_moe_router_loss:aux_alone_trains_the_router", moe_path)[0]
    assert router_change > 1e-3 and expert_change == 0.0
    assert auxes[-1] < auxes[0], auxes          # the routing becomes more balanced


@pytest.mark.cpu_dist
def test_grpo_run_logs_router_loss_and_expert_load(tmp_path, moe_path):
    """realign run of the tiny GRPO with a Qwen3-MoE actor (2 steps, one CPU worker):
    every row has the actor's router_aux_loss and expert load; the report draws them."""
    import shutil

    import yaml

    from realign.assets.tiny import make_tiny_assets
    from tests.run.conftest import REPO
    from tests.run.run_records import metrics

    make_tiny_assets(tmp_path / "tiny", seed=0, qwen2=False)
    shutil.copy(REPO / "experiments" / "tiny_reward.py", tmp_path / "tiny_reward.py")
    cfg = yaml.safe_load((REPO / "experiments" / "tiny-grpo-cpu.yaml").read_text())
    cfg["models"]["actor"] = moe_path
    cfg["cluster"]["gpus_per_node"] = 1
    cfg["run"].update(steps=2, checkpoint_interval=100)
    exp = tmp_path / "moe-grpo.yaml"
    exp.write_text(yaml.safe_dump(cfg))
    rd = tmp_path / "run"
    cli = [sys.executable, "-m", "realign.cli.main"]
    r = subprocess.run([*cli, "run", str(exp), "--run-dir", str(rd)], capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(rd)
    assert len(rows) == 2
    for row in rows:
        # top 2 of 8 experts: 2 under uniform routing, more when unbalanced
        assert 1.5 < row["actor.router_aux_loss"] < 8, row
        assert 1.0 <= row["actor.expert_load_max_over_mean"] <= row[
            "actor.expert_load_max_over_mean_worst"] <= 4.0
    r = subprocess.run([*cli, "report", str(rd), "--out", str(tmp_path / "r.html")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    page = (tmp_path / "r.html").read_text()
    assert 'id="curve-router"' in page and 'id="curve-expert-load"' in page
