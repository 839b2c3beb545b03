"""A mixture of experts (tiny Qwen3-MoE, fp32) generating on vLLM, fed in memory from a
realign replica, in a one-rank gloo world in this process (vLLM's engine core runs in
its child process): greedy tokens equal realign's own engine's and transformers',
log-probs the training forward's, a changed expert reaches the next generate; and
rollout routing replay: the experts vLLM routed each token to, recorded per layer,
replayed in the training forward, which then routes every recorded token as vLLM did."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 17, 40, 3, 42, 7], [1, 11, 12], [1, 50, 1, 2, 3], [1, 60, 61, 62, 63, 64]]
N = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    return make_model(tmp_path_factory.mktemp("vllm_moe") / "moe", "qwen3_moe", seed=31,
                      arch=dict(TINY_QWEN3_MOE, initializer_range=0.3,
                                max_position_embeddings=64))


@pytest.fixture(scope="module")
def shard(world, model_dir):
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import load_hf_weights, spec_from_hf
    from realign.runtime.model import build_model

    spec = spec_from_hf(model_dir)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1), Layout(tp=1, pp=1, dp=1))
    s = build_model(spec, "lm", groups, init_device("cpu", dtype="fp32"), init_weights=False)
    load_hf_weights(s, model_dir)
    return s


@pytest.fixture(scope="module")
def engine(world, model_dir, shard):
    from realign.runtime.engines.vllm_engine import VLLMEngine
    from realign.runtime.settings import VLLMSettings

    assert shard.spec.moe is not None
    e = VLLMEngine(model_dir, VLLMSettings(kv_cache_gib=0.25, max_num_seqs=64), torch.float32,
                   max_model_len=64, moe_top_k=shard.spec.moe.top_k)
    yield e
    e.close()


def own(shard, prompts, p):
    from realign.runtime.engines.generate import GenerateEngine

    return GenerateEngine(shard, pad_id=0).generate(prompts, p)


def training_forward(shard, tokens: torch.Tensor, replay=None):
    """(log-prob of each next token [b, s-1], experts per sparse layer [b, s, layers, k])
    of realign's training forward over ``tokens`` [b, s] (``replay``: the experts to
    route to, [b, s, layers, k])."""
    from realign.runtime.engines.train import TrainConfig, TrainEngine
    from realign.runtime.moe import recording
    from realign.runtime.router_replay import replaying

    forward = TrainEngine(shard, TrainConfig(lr=1e-3))._plain_forward(tokens.shape[1])
    layers = [] if replay is None else list(replay.unbind(dim=2))
    with torch.no_grad(), recording(shard.module) as rec, \
            (replaying(shard.module, layers) if replay is not None else _nothing()):
        logits = forward(tokens)
    vocab = logits[..., :shard.spec.vocab_size].float()     # the padding left out
    logprobs = torch.log_softmax(vocab, dim=-1)[:, :-1].gather(
        -1, tokens[:, 1:, None])[..., 0]
    return logprobs, torch.stack(rec.experts, dim=2)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_greedy_tokens_equal_own_engine_transformers_and_training(shard, engine, model_dir):
    import transformers
    from safetensors.torch import load_file

    from realign.runtime.settings import SamplingParams

    p = SamplingParams(max_new_tokens=N, greedy=True)
    nbytes = engine.load(shard)             # every expert under its Hugging Face name
    ckpt = load_file(str(model_dir / "model.safetensors"))
    assert any(".mlp.experts.7.down_proj." in k for k in ckpt)
    assert nbytes == sum(t.numel() * t.element_size() for t in ckpt.values())
    v, o = engine.generate(shard, PROMPTS, p, pad_id=0), own(shard, PROMPTS, p)
    assert v.tokens.tolist() == o.tokens.tolist()
    assert v.lengths.tolist() == [N] * len(PROMPTS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == v.tokens[i].tolist()
        # vLLM's log-probs against the training forward's over the same sequence
        seq = torch.tensor([prompt + v.tokens[i].tolist()])
        scored, _ = training_forward(shard, seq)
        gap = (scored[0, len(prompt) - 1:] - v.logprobs[i]).abs().max()
        assert float(gap) < 1e-4


def test_a_changed_expert_reaches_the_next_generate(shard, engine):
    from realign.runtime.moe import MoeMLP
    from realign.runtime.settings import SamplingParams

    p = SamplingParams(max_new_tokens=N, greedy=True)
    engine.load(shard)
    before = engine.generate(shard, PROMPTS, p, pad_id=0)
    moe = next(m for m in shard.module.modules() if isinstance(m, MoeMLP))
    changed = [moe.router.weight, *moe.fc1s().values(), *moe.fc2s().values()]
    saved = [t.detach().clone() for t in changed]
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for t in changed:           # the first sparse layer's router and experts only
            t.add_(0.5 * torch.randn(t.shape, generator=g))
    engine.load(shard)
    after = engine.generate(shard, PROMPTS, p, pad_id=0)
    mine = own(shard, PROMPTS, p)
    with torch.no_grad():
        for t, old in zip(changed, saved):
            t.copy_(old)
    assert after.tokens.tolist() == mine.tokens.tolist() != before.tokens.tolist()
    assert torch.allclose(after.logprobs, mine.logprobs, atol=1e-4)
    engine.load(shard)
    assert engine.generate(shard, PROMPTS, p, pad_id=0).tokens.tolist() == before.tokens.tolist()


def test_replayed_training_forward_routes_as_vllm_did(shard, engine):
    from realign.runtime.router_replay import routing_mismatch
    from realign.runtime.settings import SamplingParams

    engine.load(shard)
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, shard.spec.vocab_size, (8, 6), generator=g).tolist()
    gen = engine.generate(shard, prompts, SamplingParams(max_new_tokens=N, seed=2), pad_id=0)
    assert engine.routing is not None
    rolled = torch.stack(engine.routing.last)           # [b, 6 + N, layers, k]
    sparse, k = shard.spec.sparse_layers(), shard.spec.moe.top_k
    assert rolled.shape == (8, 6 + N, sparse, k)
    assert bool((rolled[:, :-1] >= 0).all()) and bool((rolled[:, -1] == -1).all())
    tokens = torch.cat([torch.tensor(prompts), gen.tokens], dim=1)

    free_lp, free = training_forward(shard, tokens)
    differ, compared = routing_mismatch(rolled, free)
    assert compared == 8 * (6 + N - 1)
    # fp32 on both sides: the record is aligned (a shifted one differs on most tokens)
    assert differ / compared < 0.05
    shifted, _ = routing_mismatch(rolled[:, :-2], free[:, 1:-1])
    assert shifted / compared > 0.5

    replay_lp, replayed = training_forward(shard, tokens, replay=rolled)
    assert routing_mismatch(rolled, replayed) == (0, compared)
    assert torch.equal(replayed[:, :-1], rolled[:, :-1].to(replayed.dtype))
    gap = (replay_lp[:, 5:] - gen.logprobs).abs().max()
    assert float(gap) < 1e-4


def test_replay_forces_the_experts_given(shard):
    """Replay is not a no-op: experts that the router would not choose are used."""
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(3, shard.spec.vocab_size, (2, 10), generator=g)
    _, free = training_forward(shard, tokens)
    E = shard.spec.moe.n_experts
    forced = (free + 1) % E                             # every token elsewhere
    forced[0, 3] = -1                                   # unknown: the router's own
    lp, got = training_forward(shard, tokens, replay=forced)
    # its first sparse layer routes as before (later layers see the forced tokens
    # through attention)
    assert torch.equal(got[0, 3, 0], free[0, 3, 0])
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, 3] = False
    assert torch.equal(got[keep], forced[keep])
    free_lp, _ = training_forward(shard, tokens)
    assert float((lp - free_lp).abs().max()) > 1e-3


def test_grpo_run_logs_the_routing_mismatch(tiny_assets, tmp_path):
    """A 2-step GRPO run of the tiny Qwen3-MoE with rollout.engine vllm: every step logs
    the share of rollout tokens whose experts differ between vLLM and the training
    forward, small in fp32, and the rollout's log-probs stay the training forward's."""
    import json

    from realign.assets.tiny_cmd import make_moe_actor
    from realign.cli.main import main
    from tests.run.conftest import experiment

    if not (tiny_assets / "tiny" / "moe_actor").is_dir():
        make_moe_actor(tiny_assets / "tiny")
    exp = experiment(tiny_assets, "tiny-grpo-vllm-cpu", tmp_path, run__steps=2,
                     models__actor="tiny/moe_actor")
    assert main(["run", str(exp), "--run-dir", str(tmp_path / "run")]) == 0
    rows = [json.loads(line)
            for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= row["moe.routing_mismatch"] < 0.05
        # every rollout token vLLM ran forward: 64 sequences of 4 new tokens and more
        assert row["moe.routing_tokens"] >= 64 * 4
        assert row["actor.rollout_logprob_diff_max"] < 1e-3


def test_tp2_engine_fed_from_a_tp2_replica(tmp_path):
    """TP 2: a TP 2 replica (each expert split over TP) feeds vLLM at TP 2 in memory:
    after a weight change its greedy tokens are realign's own engine's at TP 2 (log-probs
    within 1e-4), and after restoring the weights the first ones again. Experts of 64
    (32 per TP rank): vLLM's x86 CPU experts pad a smaller per-rank size to 32, which its
    in-memory reload cannot take (docs/vllm.md)."""
    import json

    from realign.assets.tiny import TINY_QWEN3_MOE, make_model
    from tests.vllm.cases_vllm_tp import spawn, tp_parity

    path = make_model(tmp_path / "moe64", "qwen3_moe", seed=31,
                      arch=dict(TINY_QWEN3_MOE, initializer_range=0.3, moe_intermediate_size=64,
                                max_position_embeddings=64))
    spawn(tp_parity, 2, str(path), str(tmp_path))
    tp2 = json.loads((tmp_path / "rank0.json").read_text())
    assert tp2["hosts"] and tp2["bytes"] > 0
    assert tp2["changed"] == tp2["own_changed"] != tp2["before"]
    assert tp2["changed_logprob_diff"] < 1e-4
    assert tp2["restored"] == tp2["before"]
