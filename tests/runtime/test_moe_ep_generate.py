"""Generation with expert parallelism in realign's own engine, on real gloo ranks, fp32:
the tiny Qwen3-MoE (8 experts, top 2) at DP2·EP2 generates the greedy tokens and
log-probs of DP2·EP1, in waves and refilling, with stop tokens that end one rank's rows
long before the other's (the rank that has finished keeps joining the other's token
exchanges with zero tokens, so nobody hangs); and the experts each token was sent to
while it was generated are those the training forward sends it to at EP2, so the rollout
log-probs are the training forward's."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cpu_dist

N = 24          # generated tokens (three stop checks)
P, NR = 6, 7    # the routing-identity case: prompt tokens, generated tokens


def _prompts(vocab: int, rows: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (3 + (i * 5) % 7,), generator=g).tolist()
            for i in range(rows)]


# ---- cases run inside the gloo world -------------------------------------------------

def generate_ep(ctx, path, dp, ep, stops, waves, refill, tp=1):
    """(tokens, log-probs, lengths, this rank's decode steps, its dp rank) of the greedy
    continuations of 8 prompts of 3-9 tokens at TP ``tp`` x DP ``dp`` with experts over
    EP ``ep``."""
    from cases_moe_ep import replica_ep

    from realign.runtime.engines.generate import GenerateEngine
    from realign.runtime.sampling import SamplingParams

    shard = replica_ep(ctx, path, tp, dp, ep)
    if shard is None:
        return None
    gen = GenerateEngine(shard).generate(
        _prompts(shard.spec.vocab_size),
        SamplingParams(max_new_tokens=N, seed=1, stop_token_ids=tuple(stops)),
        waves=waves, refill=refill, capture="off")
    return gen.tokens, gen.logprobs, gen.lengths, gen.decode_steps, shard.groups.dp_rank


def route_alike_ep(ctx, path):
    """At DP2·EP2: (generation's forward calls, tokens compared, tokens whose expert
    set differs in the padded training forward, max |rollout log-prob - training
    forward's|) on this rank's 4 of 8 rows."""
    from cases_moe_ep import replica_ep

    from realign.runtime.engines.generate import GenerateEngine
    from realign.runtime.engines.inference import InferenceEngine
    from realign.runtime.engines.train import TrainConfig, TrainEngine
    from realign.runtime.moe import recording
    from realign.runtime.sampling import SamplingParams

    shard = replica_ep(ctx, path, 1, 2, 2)
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, shard.spec.vocab_size, (8, P), generator=g).tolist()
    sparse = shard.spec.sparse_layers()
    with recording(shard.module) as rec:
        gen = GenerateEngine(shard).generate(prompts, SamplingParams(max_new_tokens=NR,
                                                                     seed=3),
                                             refill=False, capture="off")
    calls = len(rec.experts) // sparse
    rolled = [torch.cat([rec.experts[c * sparse + i] for c in range(calls)], dim=1)
              for i in range(sparse)]
    tokens = torch.cat([torch.tensor(prompts), gen.tokens], dim=1)
    mine = slice(4 * shard.groups.dp_rank, 4 * shard.groups.dp_rank + 4)
    seen = P + NR - 1
    engine = TrainEngine(shard, TrainConfig(lr=1e-3, packing=False))
    with torch.enable_grad(), recording(shard.module) as padded:
        engine._plain_forward(P + NR)(tokens[mine])
    differ = 0
    for i in range(sparse):
        want = rolled[i][:, :seen].sort(dim=-1).values
        got = padded.experts[i][:, :seen].sort(dim=-1).values
        differ += int((got != want).any(-1).sum())
    batch = {"tokens": tokens, "lengths": torch.full((8,), P + NR)}
    scored = InferenceEngine(shard).inference(batch)["logprobs"][:, P - 1:]
    return calls, sparse * 4 * seen, differ, float((scored - gen.logprobs).abs().max())


def capture_on_refused(ctx, path):
    """The error of a generate call at DP2·EP2 told to capture its decode steps."""
    from cases_moe_ep import replica_ep

    from realign.errors import UserError
    from realign.runtime.engines.generate import GenerateEngine
    from realign.runtime.sampling import SamplingParams

    shard = replica_ep(ctx, path, 1, 2, 2)
    try:
        GenerateEngine(shard).generate([[5, 6, 7]] * 2, SamplingParams(max_new_tokens=2),
                                       capture="on")
    except UserError as e:
        return e.field, str(e)
    return None, "no error"


# ---- tests ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    arch = dict(TINY_QWEN3_MOE, initializer_range=0.3)   # clear top-k margins
    return str(make_model(tmp_path_factory.mktemp("moe_ep_gen") / "moe", "qwen3_moe",
                          seed=11, arch=arch))


def early_stops(tokens: torch.Tensor) -> list[int]:
    """Stop tokens that end rows 0-3 (data-parallel rank 0's) early and never rows 4-7:
    each of rows 0-3's first generated token that rows 4-7 never generate."""
    others = set(tokens[4:].reshape(-1).tolist())
    stops = []
    for row in tokens[:4].tolist():
        stops.append(next(t for t in row if t not in others))
    return sorted(set(stops))


@pytest.fixture(scope="module")
def stops(world2, moe_path):
    free = world2.run("test_moe_ep_generate:generate_ep", moe_path, 2, 1, [], 1, False)[0]
    return early_stops(free[0])


@pytest.mark.parametrize("waves,refill", [(1, False), (2, False), (2, True)])
def test_dp2_ep2_greedy_equals_dp2_ep1_one_rank_finishing_first(world2, moe_path, stops,
                                                                 waves, refill):
    ep1 = world2.run("test_moe_ep_generate:generate_ep", moe_path, 2, 1, stops, waves, refill)
    ep2 = world2.run("test_moe_ep_generate:generate_ep", moe_path, 2, 2, stops, waves, refill)
    for (t1, lp1, n1, steps1, _), (t2, lp2, n2, steps2, _) in zip(ep1, ep2):
        assert torch.equal(t1, t2) and torch.equal(n1, n2)
        assert float((lp1 - lp2).abs().max()) < 1e-5
        assert steps1 == steps2
    _, _, lengths, _, _ = ep2[0]
    # rank 0's rows stop early, rank 1's run to the end: rank 0 decodes fewer steps and
    # the other rank's exchanges still completed
    assert int(lengths[:4].max()) < N and int(lengths[4:].min()) == N
    (_, _, _, steps0, dp0), (_, _, _, steps1, dp1) = ep2
    assert (dp0, dp1) == (0, 1) and steps0 < steps1, (steps0, steps1)


def test_ep2_rollout_routes_as_training(world2, moe_path):
    got = world2.run("test_moe_ep_generate:route_alike_ep", moe_path)
    for calls, compared, differ, logprob_diff in got:
        assert calls == NR                  # one prefill, NR - 1 decode steps
        assert compared == 2 * 4 * (P + NR - 1)
        assert differ == 0
        assert logprob_diff < 1e-5, logprob_diff


@pytest.mark.slow
def test_tp2_dp2_ep2_greedy_equals_tp2_dp2_ep1_one_rank_finishing_first(moe_path):
    """Four ranks: the experts split over TP inside each EP rank, the ranks of one TP
    position exchanging tokens; both TP ranks of the data-parallel rank that finishes
    first keep joining the exchanges."""
    from realign.runtime.local_world import LocalWorld

    with LocalWorld(4, timeout_s=300) as w:
        free = w.run("test_moe_ep_generate:generate_ep", moe_path, 2, 1, [], 1, False, 2)[0]
        stops = early_stops(free[0])
        got = {ep: w.run("test_moe_ep_generate:generate_ep", moe_path, 2, ep, stops, 2, True,
                         2) for ep in (1, 2)}
    for (t1, lp1, n1, steps1, _), (t2, lp2, n2, steps2, _) in zip(got[1], got[2]):
        assert torch.equal(t1, t2) and torch.equal(n1, n2) and steps1 == steps2
        assert float((lp1 - lp2).abs().max()) < 1e-5
    lengths = got[2][0][2]
    assert int(lengths[:4].max()) < N and int(lengths[4:].min()) == N
    steps = [r[3] for r in got[2]]
    assert [r[4] for r in got[2]] == [0, 0, 1, 1] and steps[0] == steps[1] < steps[2] == steps[3]


def test_captured_decode_steps_are_refused_at_ep2(world2, moe_path):
    """rollout.capture: on at EP 2 is an error naming the field (auto runs eagerly)."""
    for field, text in world2.run("test_moe_ep_generate:capture_on_refused", moe_path):
        assert field == "rollout.capture" and "ep 2" in text, text
