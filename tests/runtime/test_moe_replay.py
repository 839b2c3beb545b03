"""Rollout routing replay (R3) in the scoring and training forwards: experts recorded per
token and sparse layer (here drawn at random, so that they differ from the model's own
routing) and carried in the batch as ``routed_experts`` are forced in realign's forward
through packing, micro-batches, pipeline stages and expert parallelism: the log-probs
equal those of one padded forward with the same experts forced layer by layer, the
train call's forward uses exactly those experts (``moe.replay_mismatch`` 0), and its
recomputed backward replays alike (equal gradient norms with and without recompute)."""
from __future__ import annotations

import pytest
import torch

TOL = 1e-5
N, S = 4, 12


# ---- cases run inside the gloo world -------------------------------------------------

def _batch(shard, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of several lengths, and random experts (distinct within a token's top-k)
    for every position and sparse layer, -1 at each row's last position (a rollout
    never runs its last token forward)."""
    from cases_model import sample_batch

    moe = shard.spec.moe
    batch = sample_batch(n=N, s=S, vocab=shard.spec.vocab_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    layers = shard.spec.sparse_layers()
    routed = torch.stack([torch.randperm(moe.n_experts, generator=g)[:moe.top_k]
                          for _ in range(N * S * layers)]).view(N, S, layers, moe.top_k)
    routed = routed.to(torch.int32)
    for i, n in enumerate(batch["lengths"].tolist()):
        routed[i, n - 1:] = -1
    return {**batch, "routed_experts": routed}


def _reference_logprobs(shard, batch) -> torch.Tensor:
    """Log-probs [N, S-1] of one padded forward of the whole batch on a replica of one
    rank, each sparse layer forced to its experts by ``replaying`` directly."""
    from realign.runtime.engines.decoder import StageDecoder
    from realign.runtime.engines.inference import head_outputs
    from realign.runtime.router_replay import replaying

    routed = batch["routed_experts"].long()
    with torch.no_grad(), replaying(shard.module, [routed[:, :, j] for j in
                                                   range(routed.shape[2])]):
        out = StageDecoder(shard, max_len=S).score(batch["tokens"])
    return head_outputs(shard, out, batch)


def scored(ctx, path):
    """(padded reference, packed in 2 micro-batches with replay, the same without replay,
    padded in 2 micro-batches with replay) on a TP1 replica of rank 0."""
    from cases_model import replica

    from realign.runtime.engines.inference import InferenceEngine

    shard = replica(ctx, path, "lm", 1, 1, 1)
    if shard is None:
        return None
    batch = _batch(shard)
    own = {k: batch[k] for k in ("tokens", "lengths")}
    ref = _reference_logprobs(shard, batch)
    packed = InferenceEngine(shard, micro_batches=2, packing=True).inference(batch)
    unreplayed = InferenceEngine(shard, micro_batches=2, packing=True).inference(own)
    padded = InferenceEngine(shard, micro_batches=2).inference(batch)
    return ref, packed["logprobs"], unreplayed["logprobs"], padded["logprobs"]


def scored_parallel(ctx, path, pp, dp, ep):
    """Rank 0's (reference, replayed log-probs of a replica at pp x dp x ep, packed)."""
    from cases_model import replica
    from cases_moe_ep import replica_ep

    from realign.runtime.engines.inference import InferenceEngine

    shard = replica_ep(ctx, path, 1, dp, ep, pp)
    batch = _batch(shard)
    got = InferenceEngine(shard, micro_batches=2 // dp, packing=True).inference(batch)
    one = replica(ctx, path, "lm", 1, 1, 1)
    if one is None:
        return None
    return _reference_logprobs(one, batch), got["logprobs"]


def trained(ctx, path, recompute, packing):
    """The train step's metrics (before its update) of a loss whose metric ``lp_sum`` is
    the micro-batch's log-prob sum, in 2 micro-batches, replaying; and the reference sum."""
    from cases_model import replica

    from realign.runtime.engines.train import TrainConfig, TrainEngine

    shard = replica(ctx, path, "lm", 1, 1, 1, fresh=True)
    if shard is None:
        return None
    batch = _batch(shard)
    ref = float(_reference_logprobs(shard, batch).sum())
    engine = TrainEngine(shard, TrainConfig(lr=1e-3, forward="plain", packing=packing,
                                            clip_grad=0.0), micro_batches=2,
                         recompute=recompute)

    def loss(out, mb):
        return -out.sum() / out.numel(), {"lp_sum": out.sum()}
    metrics = engine.train_step(batch, loss)
    return metrics, ref


# ---- tests ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe4_path(tmp_path_factory):
    """A tiny Qwen3-MoE of 4 layers, layer 1 dense: sparse layers 0, 2, 3 (PP2: stage 0
    holds the first, stage 1 the other two)."""
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    root = tmp_path_factory.mktemp("moe_replay")
    return str(make_model(root / "moe", "qwen3_moe", seed=5, arch=dict(
        TINY_QWEN3_MOE, num_hidden_layers=4, initializer_range=0.3)))


@pytest.mark.cpu_dist
def test_replay_through_packing_and_micro_batches(world2, moe4_path):
    ref, packed, unreplayed, padded = world2.run("test_moe_replay:scored", moe4_path)[0]
    assert float((packed - ref).abs().max()) < TOL
    assert float((padded - ref).abs().max()) < TOL
    # the forced experts are not the model's own: without replay the log-probs differ
    assert float((unreplayed - ref).abs().max()) > 1e-2


@pytest.mark.cpu_dist
@pytest.mark.parametrize("pp,dp,ep", [(2, 1, 1), (1, 2, 2)])
def test_replay_over_stages_and_experts(world2, moe4_path, pp, dp, ep):
    """PP2: each stage replays its own sparse layers' experts; DP2·EP2: each rank's rows,
    their tokens exchanged with the other rank's experts."""
    ref, got = world2.run("test_moe_replay:scored_parallel", moe4_path, pp, dp, ep)[0]
    assert float((got - ref).abs().max()) < TOL


@pytest.mark.cpu_dist
def test_train_forward_replays_and_recomputes_alike(world2, moe4_path):
    runs = {(rc, pk): world2.run("test_moe_replay:trained", moe4_path, rc, pk)[0]
            for rc, pk in ((False, True), (True, True), (False, False))}
    for metrics, ref in runs.values():
        assert metrics["moe.replay_mismatch"] == 0.0
        # each micro-batch's sum at metric scale 1, averaged over the two
        assert abs(2 * metrics["lp_sum"] - ref) < 1e-3, (metrics["lp_sum"], ref)
    norms = [m["grad_norm"] for m, _ in runs.values()]
    assert max(norms) - min(norms) < 1e-5 * max(norms), norms


@pytest.mark.torch
def test_routing_layout_helpers():
    """Stage layers on the routing's axis, a pack's routing and the replayed share."""
    from realign.data.packing import make_pack
    from realign.runtime.router_replay import (
        packed_routing,
        replayed_share,
        stage_sparse_layers,
    )

    tokens = torch.tensor([[5, 6, 7], [8, 9, 0]])
    lengths = torch.tensor([3, 2])
    routed = torch.arange(2 * 3 * 1 * 2, dtype=torch.int32).view(2, 3, 1, 2)
    pack = make_pack(tokens, lengths, [[1, 0]], 8, "segments")
    got = packed_routing(routed, pack)
    assert got.shape == (1, 8, 1, 2)
    # row 1's two tokens first, then row 0's three, then nothing
    assert got[0, :5, 0].tolist() == [[6, 7], [8, 9], [0, 1], [2, 3], [4, 5]]
    assert (got[0, 5:] == -1).all()
    r = torch.zeros(1, 3, 1, 2, dtype=torch.int32)
    r[0, 2] = -1
    assert replayed_share(r, torch.tensor([3])) == 1.0
    r[0, 1] = -1
    assert replayed_share(r, torch.tensor([3])) == 0.5

    class Spec:                             # the two fields stage_sparse_layers reads
        n_layers = 4

        @staticmethod
        def is_sparse(x):
            return x != 1
    assert stage_sparse_layers(Spec, 2, 0) == [0]
    assert stage_sparse_layers(Spec, 2, 1) == [1, 2]
    assert stage_sparse_layers(Spec, 1, 0) == [0, 1, 2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from realign.assets.tiny import make_model, make_tiny_assets

    out = tmp_path_factory.mktemp("replay_assets")
    make_tiny_assets(out, qwen2=False, small=False, families=False, tools=False)
    make_model(out / "moe", "qwen3_moe", seed=3)
    return out


@pytest.mark.torch
@pytest.mark.parametrize("actor,why", [("actor", "is dense"), ("moe", "own engine")])
def test_replay_on_where_it_cannot_replay_exits_2(assets, tmp_path, capsys, actor, why):
    """rollout.routing_replay on with a dense actor, or with a mixture of experts whose
    rollout runs on realign's own engine (its routing is the training forward's):
    exit 2 naming the field, before any worker starts (no run folder)."""
    from pathlib import Path

    import yaml

    from realign.cli.main import main

    repo = Path(__file__).resolve().parents[2]
    cfg = yaml.safe_load((repo / "experiments" / "tiny-grpo-cpu.yaml").read_text())
    cfg["models"]["actor"] = str(assets / actor)
    cfg["data"]["train"]["path"] = str(assets / "math_train.jsonl")
    cfg["reward"]["fn"] = str(repo / "experiments" / "tiny_reward.py") + ":shaped"
    cfg.setdefault("rollout", {})["routing_replay"] = "on"
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(cfg))
    code = main(["run", str(exp), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "rollout.routing_replay" in err and why in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.torch
def test_sampling_rounds_pad_the_rollout_experts_along_the_sequence():
    """DAPO's rounds of different widths: a round's experts are padded along the sequence
    with -1 (no experts: the token's own routing), never along the top-k."""
    from realign.worker.sampling_loop import concat_records

    a = {"tokens": torch.tensor([[5, 6]]), "routed_experts": torch.zeros(1, 2, 3, 2,
                                                                       dtype=torch.int32)}
    b = {"tokens": torch.tensor([[7, 8, 9]]), "routed_experts": torch.ones(1, 3, 3, 2,
                                                                         dtype=torch.int32)}
    r = concat_records([a, b], pad_id=0)["routed_experts"]
    assert r.shape == (2, 3, 3, 2)
    assert (r[0, :2] == 0).all() and (r[0, 2] == -1).all() and (r[1] == 1).all()
