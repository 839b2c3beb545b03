"""The runtime on real gloo ranks: megatron-core models from HF checkpoints against
transformers, the engines, checkpoints out, bad input. One 2-rank world (conftest)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu_dist

TOL = 1e-4
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12], [150, 1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67]]


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_llama_logits_match_transformers(world2, tiny_models, tp, pp, dp):
    res = world2.run("cases_model:logits_parity", tiny_models["llama"], tp, pp, dp)
    got = [r for r in res if r is not None]
    assert len(got) == (2 if tp * pp * dp == 2 else 1)
    for logits_diff, logprob_diff in got:
        assert logits_diff < TOL and logprob_diff < TOL


@pytest.mark.parametrize("model,tp,pp", [("qwen2", 2, 1), ("llama_tied", 1, 2),
                                         ("llama_tied", 2, 1), ("mistral", 2, 1)])
def test_other_families_logits_match_transformers(world2, tiny_models, model, tp, pp):
    for logits_diff, logprob_diff in world2.run("cases_model:logits_parity",
                                                tiny_models[model], tp, pp, 1):
        assert logits_diff < TOL and logprob_diff < TOL


@pytest.mark.parametrize("model,head,tp,pp,micro", [
    ("llama", "lm", 1, 1, 1), ("qwen2", "lm", 2, 1, 2), ("llama_tied", "lm", 1, 2, 2),
    ("llama_rm", "value", 2, 1, 1), ("llama_rm", "value", 1, 2, 2)])
def test_scoring_forward_equals_megatrons(world2, tiny_models, model, head, tp, pp, micro):
    """Scoring runs its own forward over megatron's parameters; training runs
    megatron's. They must agree (PPO ratios start at 1)."""
    for diff in world2.run("cases_model:scoring_matches_megatron_forward", tiny_models[model],
                           head, tp, pp, micro):
        if diff is not None:
            assert diff < 1e-5


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_value_head_matches_transformers_classifier(world2, tiny_models, tp, pp):
    for values_diff, scores_diff in world2.run("cases_model:reward_parity",
                                               tiny_models["llama_rm"], tp, pp, 1):
        assert values_diff < TOL and scores_diff < TOL


@pytest.mark.parametrize("model,head,tp,pp", [("qwen2", "lm", 2, 1), ("llama_tied", "lm", 1, 2),
                                              ("llama_rm", "value", 1, 2)])
def test_logical_shards_are_the_planners_tensors(world2, tiny_models, model, head, tp, pp):
    for worst, changed in world2.run("cases_model:logical_shards_check", tiny_models[model],
                                     head, tp, pp, 1):
        assert worst == 0.0          # each slice is exactly the HF weights' slice
        assert changed > 1e-3        # writing into a logical tensor changes the model


def test_several_replicas_with_different_layouts_in_one_process(world2, tiny_models):
    res = world2.run("cases_model:several_replicas", tiny_models)
    assert [n for n, _ in res] == [2, 3]    # rank 1 also hosts the 1-GPU replica
    assert all(diff < TOL for _, diff in res)


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_greedy_generation_equals_transformers(world2, tiny_models, tp, pp, dp):
    path = tiny_models["llama"]
    ref = world2.run("cases_generate:hf_greedy", path, 8)[0]
    res = world2.run("cases_generate:generate", path, tp, pp, dp,
                     {"max_new_tokens": 8, "greedy": True})
    for r in res:
        if r is not None:
            tokens, _, lengths = r
            assert tokens == ref and lengths == [8] * 4


def test_sampling_is_seeded_and_layout_independent(world2, tiny_models):
    path = tiny_models["qwen2"]
    params = {"max_new_tokens": 6, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7}
    tp1 = world2.run("cases_generate:generate", path, 1, 1, 1, params)[0]
    again = world2.run("cases_generate:generate", path, 1, 1, 1, params)[0]
    tp2 = world2.run("cases_generate:generate", path, 2, 1, 1, params)
    dp2 = world2.run("cases_generate:generate", path, 1, 1, 2, params)
    other = world2.run("cases_generate:generate", path, 1, 1, 1, dict(params, seed=8))[0]
    assert tp1[0] == again[0]
    assert tp2[0][0] == tp2[1][0] == tp1[0] == dp2[0][0]
    assert other[0] != tp1[0]
    greedy = world2.run("cases_generate:generate", path, 1, 1, 1,
                        {"max_new_tokens": 6, "greedy": True})[0][0]
    assert greedy != tp1[0]


def test_stop_tokens_end_sequences(world2, tiny_models):
    path = tiny_models["llama"]
    greedy = world2.run("cases_generate:generate", path, 2, 1, 1,
                        {"max_new_tokens": 8, "greedy": True})[0][0]
    stop = greedy[0][2]                       # prompt 0's third token
    tokens, logprobs, lengths = world2.run(
        "cases_generate:generate", path, 1, 2, 1,
        {"max_new_tokens": 8, "greedy": True, "stop_token_ids": [stop]})[0]
    first = greedy[0].index(stop)
    assert lengths[0] == first + 1 and tokens[0][:first + 1] == greedy[0][:first + 1]
    assert tokens[0][first + 1:] == [0] * (7 - first) and logprobs[0][first + 1:] == [0.0] * (7 - first)
    for i in range(1, 4):
        n = greedy[i].index(stop) + 1 if stop in greedy[i] else 8
        assert lengths[i] == n and tokens[i][:n] == greedy[i][:n]


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 2)])
@pytest.mark.parametrize("sampling", [
    {"max_new_tokens": 6, "greedy": True},
    {"max_new_tokens": 6, "temperature": 0.8, "top_k": 40, "seed": 7}])
def test_generation_in_waves_gives_what_one_wave_gives(world2, tiny_models, tp, pp, dp,
                                                       sampling):
    """The plan's micro-batches run as waves (pipelined over the stages at pp 2): the
    sequences are those of one wave, whatever the split."""
    path = tiny_models["llama"]
    prompts = PROMPTS * 2
    whole = [r for r in world2.run("cases_generate:generate", path, tp, pp, dp, sampling,
                                   prompts, 1) if r is not None]
    for waves in (2, 4):
        split = [r for r in world2.run("cases_generate:generate", path, tp, pp, dp, sampling,
                                       prompts, waves) if r is not None]
        for (t1, lp1, n1), (t2, lp2, n2) in zip(whole, split):
            assert t1 == t2 and n1 == n2
            assert max(abs(a - b) for r1, r2 in zip(lp1, lp2) for a, b in zip(r1, r2)) < TOL


#: stop tokens that end most sampled responses within a few tokens, so slots refill
MANY_STOPS = list(range(3, 200, 6))


@pytest.mark.parametrize("tp,pp,dp,waves", [(1, 1, 1, 4), (1, 2, 1, 4), (1, 2, 1, 8),
                                            (2, 1, 1, 3), (1, 1, 2, 2)])
@pytest.mark.parametrize("sampling", [
    {"max_new_tokens": 24, "greedy": True, "stop_token_ids": MANY_STOPS[::4]},
    {"max_new_tokens": 24, "temperature": 0.9, "seed": 3, "stop_token_ids": MANY_STOPS}])
def test_generation_that_refills_gives_what_waves_give(world2, tiny_models, tp, pp, dp,
                                                       waves, sampling):
    """Slots that take the next prompt when their sequence ends (two slot groups in
    flight at pp 2) give the sequences, lengths and log-probs of waves, token for token."""
    path = tiny_models["llama"]
    prompts = [PROMPTS[i % 4][: 1 + i % 5] + [i + 3] for i in range(16)]
    want = [r for r in world2.run("cases_generate:generate", path, tp, pp, dp, sampling,
                                  prompts, 1) if r is not None]
    got = [r for r in world2.run("cases_generate:generate", path, tp, pp, dp, sampling,
                                 prompts, waves, True) if r is not None]
    assert len(got) == len(want) == tp * pp * dp
    lengths = want[0][2]
    assert min(lengths) < 8 and max(lengths) > 2 * min(lengths)    # slots did refill
    for (t1, lp1, n1), (t2, lp2, n2) in zip(want, got):
        assert t1 == t2 and n1 == n2
        assert max(abs(a - b) for r1, r2 in zip(lp1, lp2) for a, b in zip(r1, r2)) < TOL


def test_refill_runs_the_decode_steps_of_the_planners_slot_schedule(world2, tiny_models):
    """The runtime decodes exactly the iterations the planner's slot schedule
    (planner.graph.refill.slot_schedule) gives for the lengths it generated: every
    iteration in which a slot holds a sequence admitted earlier; and fewer than waves."""
    from planner.graph.refill import slot_schedule

    path = tiny_models["llama"]
    prompts = [PROMPTS[i % 4][: 1 + i % 5] + [i + 3] for i in range(16)]
    sampling = {"max_new_tokens": 24, "temperature": 0.9, "seed": 3, "stop_token_ids": MANY_STOPS}
    lengths, steps = world2.run("cases_generate:generate_steps", path, sampling, prompts, 4,
                                True)[0]
    sched = slot_schedule(lengths, 4, 24)
    busy = {i for a, f in sched for i in range(a + 1, f)}
    assert steps == len(busy) > 0
    _, wave_steps = world2.run("cases_generate:generate_steps", path, sampling, prompts, 4,
                               False)[0]
    assert steps < wave_steps


def test_waves_end_at_stop_tokens_across_the_pipeline(world2, tiny_models):
    """A wave whose rows all stopped ends early on every stage; the other waves run on."""
    path = tiny_models["llama"]
    greedy = {"max_new_tokens": 8, "greedy": True}
    ref = world2.run("cases_generate:generate", path, 1, 1, 1, greedy, PROMPTS, 1)[0][0]
    stop = ref[0][1]
    params = dict(greedy, stop_token_ids=[stop])
    one = world2.run("cases_generate:generate", path, 1, 1, 1, params, PROMPTS, 1)[0]
    for tokens, logprobs, lengths in world2.run("cases_generate:generate", path, 1, 2, 1,
                                                params, PROMPTS, 4):
        assert tokens == one[0] and lengths == one[2]
        assert max(abs(a - b) for r1, r2 in zip(logprobs, one[1]) for a, b in zip(r1, r2)) < TOL
    assert one[2][0] == 2                     # prompt 0 stopped after its second token


@pytest.mark.parametrize("tp,pp,dp,waves", [(1, 1, 1, 1), (1, 1, 1, 4), (1, 2, 1, 1),
                                            (1, 2, 1, 2), (1, 2, 1, 4), (2, 1, 1, 2),
                                            (1, 1, 2, 2)])
def test_peak_kv_cache_is_the_cost_models(world2, tiny_models, tp, pp, dp, waves):
    """The runtime's measured peak KV-cache bytes (the waves in flight) are exactly the
    cost model's figure for the same call, layout and micro-batches."""
    from planner.cost.cost_config import CostModelConfig
    from planner.cost.cost_model import CostModel
    from planner.graph.dataflow import MFC
    from planner.specs.cluster import ClusterSpec, resolve_device
    from planner.specs.layout import Layout
    from planner.specs.model_spec import ModelSpec

    n_prompts, prompt_len, n = 8, 6, 5
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=2, device=resolve_device("cpu")),
                   CostModelConfig(param_dtype_bytes=4))          # fp32 on CPU
    mfc = MFC(name="actor.generate", role="actor", kind="generate", n_seqs=n_prompts,
              prompt_len=prompt_len, gen_len=n, input_keys=("prompts",), output_keys=("seqs",))
    got = [r for r in world2.run("cases_generate:kv_cache_peak", tiny_models["llama"], tp, pp,
                                 dp, n_prompts, prompt_len, n, waves) if r is not None]
    assert len(got) == tp * pp * dp
    for measured, spec_json in got:
        want = cm.kv_cache_bytes(ModelSpec.model_validate_json(spec_json), mfc,
                                 Layout(tp=tp, pp=pp, dp=dp), waves)
        assert measured == want > 0


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_generation_logprobs_equal_inference(world2, tiny_models, tp, pp):
    for diff in world2.run("cases_generate:logprobs_match_inference", tiny_models["llama"],
                           tp, pp, 1):
        assert diff < TOL


@pytest.mark.parametrize("model,head,tp,pp,dp,micro,distopt,forward", [
    ("llama", "lm", 2, 1, 1, 2, True, "plain"),
    ("llama_tied", "lm", 1, 2, 1, 2, True, "plain"),   # 1F1B; tied embedding synced over stages
    ("qwen2", "lm", 1, 1, 2, 1, True, "plain"),
    ("llama", "lm", 1, 1, 2, 2, False, "plain"),
    ("llama_rm", "value", 2, 1, 1, 1, True, "plain"),
    ("llama", "lm", 2, 1, 1, 2, True, "megatron"),
    ("llama_tied", "lm", 1, 2, 1, 2, True, "megatron"),
    ("llama_rm", "value", 2, 1, 1, 1, True, "megatron"),
])
def test_train_step_matches_pytorch_reference(world2, tiny_models, model, head, tp, pp, dp,
                                              micro, distopt, forward):
    """Both training forwards (megatron's layers, the plain decoder forward) give the
    PyTorch reference's losses, grad norms and updated weights."""
    path, steps = tiny_models[model], 2
    ref_hist, ref_out = world2.run("cases_train:reference", path, head, dp * micro, steps)[0]
    for hist, out in world2.run("cases_train:train", path, head, tp, pp, dp, micro, steps,
                                distopt, forward):
        for step, (got, want) in enumerate(zip(hist, ref_hist)):
            # step 0 is exact up to float order; Adam's first update (lr 1e-2) amplifies
            # rounding in near-zero gradients, so later steps get a looser bound
            rel = 1e-5 if step == 0 else 1e-3
            assert got["loss"] == pytest.approx(want["loss"], rel=rel)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=rel)
            assert got["update_ok"] == 1.0
        assert float((out - ref_out).abs().max()) < 2e-3


@pytest.mark.parametrize("tp,pp,dp,forward", [(2, 1, 1, "plain"), (1, 2, 1, "plain"),
                                              (1, 1, 2, "megatron")])
def test_activation_recompute_trains_like_the_reference(world2, tiny_models, tp, pp, dp,
                                                        forward):
    """The plan's activation_recompute (each layer recomputed in the backward) gives the
    PyTorch reference's losses, grad norms and weights, like training without it."""
    path, steps = tiny_models["llama"], 2
    ref_hist, ref_out = world2.run("cases_train:reference", path, "lm", dp, steps)[0]
    for hist, out in world2.run("cases_train:train", path, "lm", tp, pp, dp, 1, steps, True,
                                forward, True):
        for step, (got, want) in enumerate(zip(hist, ref_hist)):
            rel = 1e-5 if step == 0 else 1e-3
            assert got["loss"] == pytest.approx(want["loss"], rel=rel)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=rel)
        assert float((out - ref_out).abs().max()) < 2e-3


def test_optimizer_offload_on_cpu_names_the_setting(world2, tiny_models):
    for field, msg in world2.run("cases_train:offload_on_cpu", tiny_models["llama"]):
        assert field == "plan.cost.optimizer_offload" and "device cpu" in msg


@pytest.mark.parametrize("forward", ["plain", "megatron"])
def test_generation_and_scoring_outputs_feed_training(world2, tiny_models, forward):
    for ordinary, update_ok in world2.run("cases_generate:outputs_feed_training",
                                          tiny_models["llama"], 1, 1, 2, forward):
        assert ordinary and update_ok == 1.0


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 2), (1, 2, 1)])
def test_unreduced_train_metrics_are_each_dp_ranks_own(world2, tiny_models, tp, pp, dp):
    """``dp_mean=False``: each DP rank's last stage returns its own loss (their mean is
    the reduced loss, i.e. the reference's); other stages only the global metrics."""
    path = tiny_models["llama"]
    ref_hist, _ = world2.run("cases_train:reference", path, "lm", dp, 1)[0]
    got = world2.run("cases_train:train_local_metrics", path, tp, pp, dp)
    last = [m for m, is_last, _ in got if is_last]
    assert len(last) == dp
    assert sum(m["loss"] for m in last) / dp == pytest.approx(ref_hist[0]["loss"], rel=1e-5)
    if dp > 1:
        assert last[0]["loss"] != pytest.approx(last[1]["loss"], rel=1e-3)
    for m, is_last, _ in got:
        assert m["grad_norm"] == pytest.approx(ref_hist[0]["grad_norm"], rel=1e-5)
        if not is_last:
            assert set(m) == {"grad_norm", "update_ok"}


@pytest.mark.parametrize("src,tp,pp", [("llama", 2, 1), ("llama_tied", 1, 2), ("qwen2", 1, 2)])
def test_save_in_hf_format_round_trips(world2, tiny_models, tmp_path, src, tp, pp):
    diff, files = world2.run("cases_model:save_roundtrip", tiny_models[src],
                             str(tmp_path / "out"), tp, pp, 1)[0]
    assert diff == 0.0
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) == pp


def test_sharded_checkpoint_loads_with_logits_parity(world2, tiny_models, tmp_path):
    out = str(tmp_path / "sharded")
    world2.run("cases_model:save_roundtrip", tiny_models["qwen2"], out, 1, 2, 1)
    for logits_diff, logprob_diff in world2.run("cases_model:logits_parity", out, 2, 1, 1):
        assert logits_diff < TOL and logprob_diff < TOL


def test_bad_input_raises_on_every_rank_before_any_collective(world2, tiny_models, tmp_path):
    import json
    import shutil
    msgs = world2.run("cases_model:bad_input", tiny_models["llama"], "mesh_too_big")
    assert all("exceed the world of 2 ranks" in m for m in msgs)
    msgs = world2.run("cases_model:bad_input", tiny_models["llama"], "heads")
    assert all("tp=2 must divide the 3 heads" in m for m in msgs)
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    msgs = world2.run("cases_model:bad_input", str(bad), "shapes")
    assert all("mlp.gate_proj.weight" in m and "(96, 64)" in m for m in msgs)
    msgs = world2.run("cases_model:bad_input", tiny_models["llama"], "value_head_missing")
    assert all("'score.weight' is missing" in m for m in msgs)
    # the world is still alive: no rank was left inside a collective
    assert world2.run("cases_model:logits_parity", tiny_models["llama"], 1, 1, 2)[0][0] < TOL


def test_collectives_under_polled_waits_give_their_results(world2):
    """CPU workers poll gloo works instead of sleeping in them (polled_wait.py)."""
    res = world2.run("cases_polled_wait:collectives_polled")
    for r, (results, kinds, inside, restored) in enumerate(res):
        assert inside and restored
        assert results == {
            "all_reduce": [3.0] * 3, "all_gather": [[0.0, 0.0], [1.0, 1.0]],
            "all_gather_into_tensor": [0.0, 0.0, 1.0, 1.0], "broadcast": [1.0, 1.0],
            "reduce_scatter": [3.0 * (r + 1)], "p2p": [7.0] * 3,
            "objects": [{"rank": 0}, {"rank": 1}]}
        # polled kinds report completion by themselves (else polling only adds the
        # budget); gloo's reduce-scatter does not, so it is left to the blocking wait
        assert kinds == {"all_reduce": (True, True), "all_gather": (True, True),
                         "broadcast": (True, True), "barrier": (True, True),
                         "reduce_scatter": (False, False),
                         "coalesced_all_reduce": (True, True),
                         "coalesced_all_gather": (True, True)}


@pytest.mark.parametrize("tp,pp,dp,zero1", [(1, 1, 1, False), (2, 1, 1, True),
                                            (1, 2, 1, False), (1, 1, 2, True)])
def test_a_nonfinite_gradient_stops_before_the_update(world2, tiny_models, tp, pp, dp, zero1):
    """Every rank of the replica sees the same (reduced) gradient norm, so all of them
    stop alike (no rank left in a collective) and no parameter changes."""
    got = [r for r in world2.run("cases_train:nonfinite_gradient", tiny_models["llama"], tp,
                                 pp, dp, zero1) if r is not None]
    assert len(got) == tp * pp * dp
    assert all(raised and changed == 0.0 for raised, changed in got), got


@pytest.mark.parametrize("tp,pp,dp,zero1,kind", [
    (1, 1, 1, False, "Float16OptimizerWithFloat16Params"),
    (1, 1, 2, True, "DistributedOptimizer"), (2, 1, 1, False, "Float16OptimizerWithFloat16Params"),
    (1, 2, 1, True, "DistributedOptimizer")])
def test_bf16_resume_restores_the_fp32_main_weights(world2, tiny_models, tp, pp, dp, zero1, kind):
    """A resumed bf16 replica continues exactly where an uninterrupted one is: its
    optimizer's fp32 main weights come from the checkpoint (not cloned from the initial
    or the bf16-rounded weights)."""
    got = [r for r in world2.run("cases_train:bf16_resume", tiny_models["llama"], tp, pp, dp,
                                 zero1) if r is not None]
    assert len(got) == tp * pp * dp
    for diff, kinds in got:
        assert kinds == [kind]
        assert diff == 0.0


@pytest.mark.parametrize("tp,pp,dp,zero1,dtype", [
    (1, 1, 2, True, "fp32"), (1, 2, 1, True, "bf16"), (2, 1, 1, False, "bf16")])
def test_training_state_offload_frees_the_state_between_calls_and_changes_nothing(
        world2, tiny_models, tp, pp, dp, zero1, dtype):
    """The plan's train_state_offload: between train calls the gradients and the
    optimizer's device state take no memory, and training is bit-identical to the same
    engine without it (fp32 and bf16 main weights, distributed or not)."""
    got = [r for r in world2.run("cases_train:state_offload", tiny_models["llama"], tp, pp,
                                 dp, zero1, dtype) if r is not None]
    assert len(got) == tp * pp * dp
    for diff, freed, same, n_parked, metrics in got:
        assert [m for m, _ in metrics] == [m for _, m in metrics]
        assert diff == 0.0 and freed and same
        assert n_parked > 0


def test_a_layout_built_again_reuses_its_process_groups(world2, tiny_models):
    """Each gloo group keeps threads of its own: replicas at a layout built before (the
    reference beside its actor, a model rebuilt) take the groups made for it."""
    for same, grown in world2.run("cases_model:groups_reused", tiny_models["llama"]):
        assert same and grown == 0
