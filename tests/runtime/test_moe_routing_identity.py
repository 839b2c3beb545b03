"""Routing identity between rollout and training with realign's own engine (Qwen3-MoE,
fp32, gloo ranks): the experts each token was sent to while it was generated (prefill and
KV-cache decode steps, recorded on the layers) are the experts the training forward
sends it to (padded and packed), at TP1 and TP2, and the rollout's log-probs are the
training forward's, so the log-prob mismatch of a mixture of experts stays zero; the
vLLM rollout's mismatch scored in chunks of rows counts as the whole share scored at
once."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cpu_dist

P, N = 6, 7     # prompt tokens, generated tokens


def _sorted(experts: torch.Tensor) -> torch.Tensor:
    return experts.sort(dim=-1).values


def rollout_and_training_route_alike(ctx, path, tp):
    """(generation's forward calls, tokens compared, tokens whose expert set differs in
    the padded / the packed training forward, max |rollout log-prob - training
    forward's|) on this rank."""
    from cases_model import replica

    from realign.data.packing import train_packs
    from realign.runtime.engines.generate import GenerateEngine
    from realign.runtime.engines.inference import InferenceEngine
    from realign.runtime.engines.packed_attention import kernel_for
    from realign.runtime.engines.train import TrainConfig, TrainEngine
    from realign.runtime.moe import recording
    from realign.runtime.sampling import SamplingParams

    shard = replica(ctx, path, "lm", tp, 1, 1)
    if shard is None:
        return None
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, shard.spec.vocab_size, (4, P), generator=g).tolist()
    sparse = shard.spec.sparse_layers()
    with recording(shard.module) as rec:
        gen = GenerateEngine(shard).generate(prompts, SamplingParams(max_new_tokens=N, seed=3),
                                             refill=False, capture="off")
    calls = len(rec.experts) // sparse              # the prefill and each decode step
    # per sparse layer: the prefill's [b, P, k] then each step's [b, 1, k]
    rolled = [torch.cat([rec.experts[c * sparse + i] for c in range(calls)], dim=1)
              for i in range(sparse)]
    tokens = torch.cat([torch.tensor(prompts), gen.tokens], dim=1)
    batch = {"tokens": tokens, "lengths": torch.full((4,), P + N)}
    seen = P + N - 1                                # the last token is never fed forward

    engine = TrainEngine(shard, TrainConfig(lr=1e-3))
    with torch.enable_grad(), recording(shard.module) as padded:
        engine._plain_forward(P + N)(tokens)
    pack = train_packs([batch], kernel_for("cpu"))[0]
    with torch.enable_grad(), recording(shard.module) as packed:
        engine._plain_forward(P + N)(pack.tokens, pack)
    differ_padded = differ_packed = 0
    for i in range(sparse):
        want = _sorted(rolled[i][:, :seen])
        differ_padded += int((_sorted(padded.experts[i][:, :seen]) != want).any(-1).sum())
        flat = packed.experts[i].reshape(-1, packed.experts[i].shape[-1])
        from_pack = torch.stack([flat[pack.index[j, :seen]]
                                 for j in torch.argsort(pack.rows).tolist()])
        differ_packed += int((_sorted(from_pack) != want).any(-1).sum())
    scored = InferenceEngine(shard).inference(batch)["logprobs"][:, P - 1:]
    return (calls, sparse * 4 * seen, differ_padded, differ_packed,
            float((scored - gen.logprobs).abs().max()))


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    root = tmp_path_factory.mktemp("moe_route")
    return str(make_model(root / "moe", "qwen3_moe", seed=31, arch=dict(
        TINY_QWEN3_MOE, initializer_range=0.3)))


@pytest.mark.parametrize("tp", [1, 2])
def test_generation_and_training_choose_the_same_experts(world2, moe_path, tp):
    got = [r for r in world2.run("test_moe_routing_identity:rollout_and_training_route_alike",
                                 moe_path, tp) if r is not None]
    assert len(got) == tp
    for calls, compared, differ_padded, differ_packed, logprob_diff in got:
        assert calls == N                   # one prefill, N - 1 decode steps
        assert compared == 2 * 4 * (P + N - 1)
        assert differ_padded == 0 and differ_packed == 0
        assert logprob_diff < 1e-5, logprob_diff


def mismatch_chunked_and_whole(ctx, path):
    """(chunked, whole, tokens altered) of ``rollout_routing_mismatch`` at DP 2: a
    rollout routing that is the training forward's own with some tokens' experts
    changed, scored one row per chunk and all rows at once."""
    from types import SimpleNamespace

    from cases_model import replica

    from realign.runtime.engines.decoder import StageDecoder
    from realign.runtime.engines.vllm_moe import rollout_routing_mismatch
    from realign.runtime.moe import recording

    shard = replica(ctx, path, "lm", 1, 1, 2)
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, shard.spec.vocab_size, (6, P), generator=g).tolist()
    lengths = torch.tensor([N, 3, N - 2, 1, N, 4])       # differing widths per DP rank
    gen = SimpleNamespace(tokens=torch.randint(3, shard.spec.vocab_size, (6, N), generator=g),
                          lengths=lengths)
    first = shard.groups.dp_rank * 3
    last, altered = [], 0
    for i in range(first, first + 3):
        seq = torch.tensor([prompts[i] + gen.tokens[i, :int(lengths[i])].tolist()])
        with torch.no_grad(), recording(shard.module) as rec:
            StageDecoder(shard, max_len=seq.shape[1]).score(seq)
        r = torch.stack(rec.experts, dim=2)[0].clone()        # [len, layers, k]
        r[-1] = -1                                            # never fed forward
        for pos in range(i % 2, r.shape[0] - 1, 3):           # some tokens rerouted
            r[pos, 0] = (r[pos, 0] + 1) % shard.spec.moe.n_experts
            altered += int(set(r[pos, 0].tolist()) != set(rec.experts[0][0, pos].tolist()))
        last.append(r)
    routing = SimpleNamespace(last=last)
    chunked = rollout_routing_mismatch(shard, routing, prompts, gen, 0, max_tokens=1)
    whole = rollout_routing_mismatch(shard, routing, prompts, gen, 0, max_tokens=10 ** 9)
    return chunked, whole, altered


def test_vllm_mismatch_scored_in_chunks_equals_the_whole(world2, moe_path):
    from realign.runtime.engines.vllm_moe import row_chunks

    assert row_chunks(5, 3, 6) == [range(0, 2), range(2, 4), range(4, 5)]
    assert row_chunks(2, 100, 6) == [range(0, 1), range(1, 2)]
    got = world2.run("test_moe_routing_identity:mismatch_chunked_and_whole", moe_path)
    altered = sum(a for _, _, a in got)
    for chunked, whole, _ in got:
        assert chunked == whole
        assert whole[1] == 6 * P + int(torch.tensor([N, 3, N - 2, 1, N, 4]).sum()) - 6
        assert 0 < altered == round(whole[0] * whole[1])
