"""Runtime pieces that need no processes: rank arithmetic of replica groups, input
checks, the HF <-> megatron tensor mapping, sampling filters, vocab-parallel log-probs.

They import torch (and some megatron-core), so they carry no ``pure`` marker (that
tier is torch-free); they run in the default CPU test run."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import stage_tensors
from realign.errors import UserError
from realign.runtime.groups import check_replica, grid_rank_enum
from realign.runtime.model import global_name

pytestmark = pytest.mark.torch

SPEC = ModelSpec(name="t", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                 vocab_size=200)


@pytest.mark.parametrize("tp,dp,pp,offset", [(2, 2, 2, 0), (2, 1, 2, 4), (1, 4, 1, 2),
                                             (4, 1, 2, 0)])
def test_group_ranks_equal_megatrons_hypercommgrid(monkeypatch, tp, dp, pp, offset):
    from megatron.core.hyper_comm_grid import HyperCommGrid

    monkeypatch.setenv("WORLD_SIZE", str(tp * dp * pp + offset))
    grid = HyperCommGrid([tp, 1, dp, pp], ["tp", "cp", "dp", "pp"], rank_offset=offset)
    ours = grid_rank_enum(Layout(tp=tp, dp=dp, pp=pp), offset)
    for kind, dims in [("tp", "tp"), ("dp", "dp"), ("pp", "pp"), ("mp", ["tp", "pp"])]:
        theirs = sorted(sorted(g) for g in grid.get_rank_enum(dims))
        assert sorted(ours[kind]) == theirs, kind
    assert ours["embd"] == [[g[0], g[-1]] if pp > 1 else [g[0]] for g in ours["pp"]]


def test_group_ranks_worked_example():
    e = grid_rank_enum(Layout(tp=2, dp=1, pp=2), 4)
    assert e["tp"] == [[4, 5], [6, 7]] and e["pp"] == [[4, 6], [5, 7]]
    assert e["embd"] == [[4, 6], [5, 7]] and e["model"] == [[4, 5, 6, 7]]


def test_check_replica_names_every_problem():
    with pytest.raises(UserError, match="exceed the world of 4 ranks"):
        check_replica(SPEC, DeviceMesh(first_gpu=4, n_gpus=2), Layout(tp=2), 4)
    with pytest.raises(UserError, match="tp=4 must divide the 4 heads and 2 KV"):
        check_replica(SPEC, DeviceMesh(first_gpu=0, n_gpus=4), Layout(tp=4), 4)
    with pytest.raises(UserError, match="pp=3 must divide the 4 layers"):
        check_replica(SPEC, DeviceMesh(first_gpu=0, n_gpus=3), Layout(pp=3), 4)
    with pytest.raises(UserError, match="needs tp\\*pp\\*dp = 2 ranks but the mesh has 4"):
        check_replica(SPEC, DeviceMesh(first_gpu=0, n_gpus=4), Layout(tp=2), 4)
    check_replica(SPEC, DeviceMesh(first_gpu=0, n_gpus=4), Layout(tp=2, pp=2), 4)


def test_global_layer_names():
    assert global_name("module.decoder.layers.1.mlp.linear_fc1.weight", SPEC, 2, 1) == \
        "decoder.layers.3.mlp.linear_fc1.weight"
    assert global_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                       SPEC, 1, 0) == "decoder.layers.0.input_layernorm.weight"
    assert global_name("embedding.word_embeddings.weight", SPEC, 2, 0) == \
        "embedding.word_embeddings.weight"


@pytest.mark.parametrize("model", ["llama", "qwen2", "llama_tied"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_shards_reassemble_to_the_checkpoint(tiny_models, model, tp):
    """read_shard for every TP rank, put back with the planner's shard ranges, then
    to_hf: exactly the checkpoint's tensors (QKV grouping, [gate; up], vocab pad)."""
    from realign.runtime.hf_checkpoint import HFReader, read_shard, spec_from_hf, to_hf

    path = tiny_models[model]
    spec, reader = spec_from_hf(path), HFReader(path)
    seen = set()
    for t in stage_tensors(spec, "lm", 1, 0):
        shards = [read_shard(reader, spec, t, r, tp) for r in range(tp)]
        assert all(s.shape == t.shard_shape(tp) for s in shards), t.name
        if t.shard_dim is None:
            full = shards[0]
        else:
            full = torch.zeros(t.shape)
            for r, s in enumerate(shards):
                for (a, b), piece in zip(t.shard_ranges(r, tp), s.chunk(t.parts, t.shard_dim)):
                    full.narrow(t.shard_dim, a, b - a).copy_(piece)
        for name, tensor in to_hf(t, full, spec).items():
            assert torch.equal(tensor, reader.whole(name)), name
            seen.add(name)
    if model == "llama_tied":
        seen.add("lm_head.weight")
    assert {n for n in reader._where if n != "lm_head.weight" or model != "llama_tied"} <= seen


def test_qkv_is_grouped_per_kv_head(tiny_models):
    """megatron's fused QKV rows: [q of group g; k_g; v_g] for each KV group g."""
    from realign.runtime.hf_checkpoint import HFReader, read_shard, spec_from_hf

    path = tiny_models["llama"]
    spec, reader = spec_from_hf(path), HFReader(path)
    qkv = next(t for t in stage_tensors(spec, "lm", 1, 0) if t.content.endswith(".qkv"))
    fused = read_shard(reader, spec, qkv, 1, 2)     # TP rank 1 of 2 = KV group 1
    d = spec.kv_channels
    q = reader.whole("model.layers.0.self_attn.q_proj.weight")
    k = reader.whole("model.layers.0.self_attn.k_proj.weight")
    assert torch.equal(fused[:2 * d], q[2 * d:4 * d])         # query heads 2, 3
    assert torch.equal(fused[2 * d:3 * d], k[d:2 * d])        # key head 1


def test_checkpoint_problems_are_user_errors(tiny_models, tmp_path):
    from realign.runtime.hf_checkpoint import HFReader, check_checkpoint, spec_from_hf

    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="k_proj.weight' has shape \\(32, 64\\) but "
                                        "config.json implies \\(64, 64\\)"):
        check_checkpoint(HFReader(bad), spec_from_hf(bad), "lm")
    # a rope scaling realign does not compute, and a llama3 one without its numbers
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 8.0}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="rope_type 'dynamic' is not supported \\(allowed: "
                                        "default, linear, llama3, yarn\\)"):
        spec_from_hf(bad)
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="llama3 needs low_freq_factor"):
        spec_from_hf(bad)
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
        spec_from_hf(bad)
    with pytest.raises(UserError, match="neither model.safetensors nor"):
        HFReader(tmp_path)


def test_sliding_window_caps_sequence_length(tiny_models):
    from realign.runtime.hf_checkpoint import spec_from_hf

    assert spec_from_hf(tiny_models["mistral"]).max_seq_len == 64
    assert spec_from_hf(tiny_models["qwen2"]).max_seq_len == 256


def test_top_k_and_top_p_filters():
    from realign.runtime.sampling import SamplingParams, filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    keep = lambda **kw: torch.isfinite(filter_logits(logits, SamplingParams(**kw)))[0].tolist()  # noqa
    assert keep(top_k=2) == [True, True, False, False]
    assert keep(top_p=0.5) == [True, False, False, False]
    assert keep(top_p=0.7) == [True, True, False, False]
    assert keep(top_p=0.75) == [True, True, False, False]
    assert keep(top_p=0.76) == [True, True, True, False]
    assert keep() == [True] * 4


def test_a_rows_draw_depends_on_its_seed_id_and_position_alone():
    from realign.runtime.sampling import SamplingParams, choose_tokens

    p = SamplingParams(seed=5)
    logits = torch.randn(3, 50)
    alone = choose_tokens(logits[1:2], p, torch.tensor([7]), 2)
    batch = choose_tokens(logits, p, torch.tensor([3, 7, 9]), 2)
    assert batch[1] == alone[0]
    other_seed = [choose_tokens(logits[1:2], SamplingParams(seed=s), torch.tensor([7]), 2)
                  for s in range(20)]
    assert len({int(t) for t in other_seed}) > 1


def test_noise_made_in_blocks_equals_noise_made_per_position(monkeypatch):
    """Generation draws its noise a block of positions at a time; every position's
    noise (hence every draw) is the one a per-position call makes, across block ends."""
    from realign.runtime.engines import waves as generate
    from realign.runtime.sampling import SamplingParams, uniform_noise, uniform_noise_block

    ids = torch.tensor([3, 7, 2 ** 33 + 5])
    block = uniform_noise_block(2 ** 40 + 9, ids, range(2, 6), 50)
    for i, t in enumerate(range(2, 6)):
        assert torch.equal(block[i], uniform_noise(2 ** 40 + 9, ids, t, 50))
    monkeypatch.setattr(generate, "NOISE_BLOCK", 2 * 3 * 50)         # two positions a block
    blocks = generate._NoiseBlocks(SamplingParams(seed=4), ids, 5, 50)
    assert blocks.per_block == 2
    for t in range(5):
        u = uniform_noise(4, ids, t, 50)
        assert torch.equal(blocks.at(t), -torch.log(-torch.log(u)))
    assert generate._NoiseBlocks(SamplingParams(greedy=True), ids, 5, 50).at(0) is None


def test_noise_of_rows_at_their_own_positions_is_each_rows_noise():
    """Refilled slots draw each row at its own position in one call: row i is the
    noise a per-position call makes for that sequence and position."""
    from realign.runtime.sampling import gumbel_noise, gumbel_noise_rows

    ids = torch.tensor([3, 7, 2 ** 33 + 5])
    rows = gumbel_noise_rows(2 ** 40 + 9, ids, [0, 5, 2], 50)
    for i, t in enumerate([0, 5, 2]):
        assert torch.equal(rows[i], gumbel_noise(2 ** 40 + 9, ids[i:i + 1], range(t, t + 1), 50)[0, 0])
    assert not torch.equal(rows[0], gumbel_noise_rows(2 ** 40 + 9, ids, [1, 5, 2], 50)[0])


def test_waves_split_the_rows_contiguously_and_evenly():
    from realign.runtime.engines.waves import wave_bounds

    assert wave_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert wave_bounds(8, 2) == [(0, 4), (4, 8)]
    assert wave_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]     # never an empty wave
    assert wave_bounds(5, 1) == [(0, 5)]


def test_sampling_frequencies_follow_the_filtered_distribution():
    from realign.runtime.sampling import SamplingParams, choose_tokens

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40000
    logits = probs.log().expand(n, 4)
    ids = torch.arange(n)
    freq = torch.bincount(choose_tokens(logits, SamplingParams(seed=1), ids, 0), minlength=4) / n
    assert torch.allclose(freq, probs, atol=0.01), freq
    top2 = torch.bincount(choose_tokens(logits, SamplingParams(seed=2, top_k=2), ids, 3),
                          minlength=4) / n
    assert torch.allclose(top2, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.01), top2


def test_hash32_matches_integer_arithmetic():
    from realign.runtime.sampling import _hash32_int, hash32

    # the tensor version avoids int64 overflow by splitting its multiplications
    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    assert hash32(torch.tensor(xs)).tolist() == [_hash32_int(x) for x in xs]


@pytest.mark.parametrize("which", ["local", "parallel"])
def test_token_logprobs_and_gradient_match_the_definition(which):
    from realign.runtime import vocab_parallel as vp

    logits = torch.randn(2, 5, 256, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 200, (2, 5))
    if which == "local":   # what token_logprobs runs without TP
        ours = vp.token_logprobs(logits, targets, None, 200)
    else:                  # the TP version, here over a single rank
        ours = vp.parallel_token_logprobs(logits, targets, None, 200)
    # log p = z_t - log sum_{v < 200} exp z_v; d/dz_v = [v = t] - p_v (v < 200), 0 past
    z = logits.detach()[..., :200]
    ref = z.gather(-1, targets[..., None])[..., 0] - z.exp().sum(-1).log()
    assert torch.allclose(ours.double(), ref, atol=1e-6)
    w = torch.randn(2, 5, dtype=torch.float64)
    g, = torch.autograd.grad((ours * w).sum(), logits)
    onehot = torch.nn.functional.one_hot(targets, 256).double()
    p = torch.cat([z.softmax(-1), torch.zeros(2, 5, 56, dtype=torch.float64)], -1)
    assert torch.allclose(g, (onehot - p) * w[..., None], atol=1e-6)


class _FakeWork:
    """A work whose op type and completion the test controls."""

    def __init__(self, op: str | None, done_after: int | None):
        self.op, self.done_after, self.polls, self.waited = op, done_after, 0, False

    def _get_op_type(self):
        from torch._C._distributed_c10d import OpType

        if self.op is None:
            raise AttributeError("_get_op_type")
        return int(OpType.__members__[self.op])      # what gloo's works answer

    def is_completed(self):
        self.polls += 1
        return self.done_after is not None and self.polls > self.done_after


def _blocking_wait(work, *args):
    work.waited = args or True
    return "waited"


def test_a_pollable_work_is_polled_until_it_completes_then_waited():
    from realign.runtime.polled_wait import poll_then_wait

    work = _FakeWork("ALLREDUCE", done_after=5)
    assert poll_then_wait(work, _blocking_wait, 10.0, "timeout-arg") == "waited"
    assert work.polls == 6 and work.waited == ("timeout-arg",)


def test_polling_stops_at_the_budget_and_falls_back_to_the_blocking_wait():
    from realign.runtime.polled_wait import poll_then_wait

    work = _FakeWork("BROADCAST", done_after=None)     # never completes by itself
    assert poll_then_wait(work, _blocking_wait, 0.01) == "waited"
    assert work.polls > 1 and work.waited is True


@pytest.mark.parametrize("op", ["_REDUCE_SCATTER_BASE", "SEND", "RECV", "UNKNOWN", None])
def test_works_that_do_not_report_completion_are_not_polled(op):
    from realign.runtime.polled_wait import poll_then_wait

    work = _FakeWork(op, done_after=None)   # None: the private op-type API is missing
    assert poll_then_wait(work, _blocking_wait, 10.0) == "waited"   # at once, no budget
    assert work.polls == 0 and work.waited is True


def test_torchs_adam_is_switched_to_its_fused_kernel_before_any_state():
    from realign.runtime.engines.optimizer_step import use_fused_adam
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.0)
    assert use_fused_adam(opt)
    assert opt.param_groups[0]["fused"] and not opt.param_groups[0]["foreach"]
    params[0].grad = torch.ones(3)
    opt.step()                                   # the fused kernel runs on CPU
    assert float(params[0][0]) == pytest.approx(0.9)
    assert not use_fused_adam(opt)               # state exists now: left alone
    assert not use_fused_adam(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))


def test_cached_attention_spans_whole_key_blocks():
    from realign.runtime.engines.decoder import KEY_BLOCK, key_span
    assert [key_span(n) for n in (1, KEY_BLOCK, KEY_BLOCK + 1)] == [
        KEY_BLOCK, KEY_BLOCK, 2 * KEY_BLOCK]
