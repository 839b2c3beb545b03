"""LoRA on real gloo ranks: realign's adapters (in both of its forwards, at TP1 and TP2)
against PEFT's own (every projection its own A) on the same base, initialisation and
batch; PEFT's files in (any subset of q/k/v and gate/up, LLaMA, Qwen2, Qwen3) and out;
scoring through them at TP2 and PP2. One 2-rank world (conftest)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu_dist


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("forward", ["plain", "megatron", "plain+recompute",
                                     "megatron+recompute"])
def test_loss_and_adapter_gradients_match_peft(world2, tiny_models, tp, forward):
    res = [r for r in world2.run("cases_lora:peft_parity", tiny_models["llama"], tp, forward)
           if r is not None]
    assert len(res) == (2 if tp == 2 else 1)
    for loss_diff, grad_rel, frozen in res:
        assert loss_diff < 1e-5          # fp32 rounding of a loss near 5.6
        assert grad_rel < 1e-4           # relative to each gradient's largest entry
        assert frozen                    # the base weights got no gradient


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_scoring_with_adapters_matches_peft(world2, tiny_models, tp, pp):
    res = [r for r in world2.run("cases_lora:logits_with_adapters", tiny_models["llama"], tp, pp)
           if r is not None]
    assert res
    for with_peft, with_base in res:
        assert with_peft < 1e-4
        assert with_base > 1e-2          # the adapters change the model


def test_dropout_masks_are_those_of_tp1_and_of_the_forward_in_recomputation(
        world2, tiny_models):
    """With dropout, TP2 (with recomputation) gives TP1's loss and gradients: every TP rank
    draws the masks TP1 draws, and the recomputed forward draws the forward's."""
    path = tiny_models["llama"]
    ref = next(r for r in world2.run("cases_lora:dropout_grads", path, 1, False) if r)
    tp2 = next(r for r in world2.run("cases_lora:dropout_grads", path, 2, True) if r)
    off = next(r for r in world2.run("cases_lora:dropout_grads", path, 1, False, 0.0) if r)
    assert abs(ref[0] - tp2[0]) < 1e-5
    for name, want in ref[1].items():
        assert (tp2[1][name] - want).abs().max() <= 1e-4 * want.abs().max(), name
    assert abs(ref[0] - off[0]) > 1e-4            # the masks act


@pytest.mark.parametrize("head,model", [("lm", "llama"), ("value", "llama_rm")])
def test_lora_training_is_the_same_at_every_layout(world2, tiny_models, head, model):
    """Three optimizer steps of the adapters (and a value head) under megatron's
    schedule, DDP and optimizer: TP2, PP2 (two micro-batches, 1F1B) and DP2 with the
    distributed optimizer give TP1's losses, grad norms and outputs."""
    path = tiny_models[model]
    runs = {}
    for tp, pp, dp, micro in ((1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 2), (1, 1, 2, 1)):
        res = [r for r in world2.run("cases_lora:lora_train", path, head, tp, pp, dp, micro, 3)
               if r is not None]
        runs[(tp, pp, dp)] = res
    (hist, out, trained), = runs[(1, 1, 1)]
    from cases_lora import LORA

    from realign.runtime.hf_checkpoint import spec_from_hf
    spec = spec_from_hf(path)
    assert trained == LORA.total_params(spec) + (spec.hidden if head == "value" else 0)
    assert hist[-1]["loss"] < hist[0]["loss"]           # the adapters learn
    for key, res in runs.items():
        for h, o, _n in res:
            for step, (a, b) in enumerate(zip(hist, h)):
                # exact up to float order at step 0; Adam's first update (lr 1e-2)
                # amplifies rounding in near-zero gradients (as the full training test)
                rel = 1e-5 if step == 0 else 1e-3
                assert b["loss"] == pytest.approx(a["loss"], rel=rel), key
                assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel), key
                assert b["update_ok"] == 1.0
            assert float((o - out).abs().max()) < 2e-3, key


def test_shared_a_matches_peft_with_equal_a_on_fused_parts(world2, tiny_models):
    """``shared_a``: one A per fused layer is PEFT with the parts' A equal (their
    gradients summed); the same at TP2."""
    from planner.specs.lora import LoraSpec

    lora = LoraSpec(rank=4, alpha=8, shared_a=True)
    for tp in (1, 2):
        res = [r for r in world2.run("cases_lora:peft_parity", tiny_models["llama"], tp,
                                     "plain", lora) if r is not None]
        assert len(res) == tp
        for loss_diff, grad_rel, frozen in res:
            assert loss_diff < 1e-5 and grad_rel < 1e-4 and frozen


TARGET_SETS = [["all-linear"], ["q_proj", "v_proj"], ["k_proj", "o_proj", "up_proj"],
               ["gate_proj", "down_proj", "v_proj"]]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("targets", TARGET_SETS, ids=lambda t: "+".join(t))
def test_an_adapter_saved_by_peft_loads_and_gives_peft_merged_logits(
        world2, tiny_models, model, tp, targets):
    """A PEFT adapter (its own random A and B per projection, any subset of the fused
    layers' parts) passes init_from's check, loads at TP1 and TP2 (B's parts sharded by
    query group and by ffn column) and gives the logits of PEFT's merged model (within
    1e-5 of the largest logit: fp32 rounding; PEFT's merged and unmerged models differ by
    about 5e-6 of it); realign trains as many parameters as PEFT."""
    res = [r for r in world2.run("cases_lora:peft_file_logits", tiny_models[model], tp,
                                 targets) if r is not None]
    assert len(res) == tp
    for merged_rel, base_diff, n_ours, n_peft in res:
        assert merged_rel <= 1e-5
        assert base_diff > 1e-2                   # the adapters change the model
        assert n_ours == n_peft


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"]],
                         ids=lambda t: "+".join(t))
def test_realign_export_loads_in_peft_with_the_same_logits(world2, tiny_models, tp, targets):
    from planner.specs.lora import LoraSpec

    res = [r for r in world2.run("cases_lora:export_logits", tiny_models["qwen2"], tp,
                                 targets) if r is not None]
    assert len(res) == 1
    rel, adapted, config_targets = res[0]
    assert rel <= 1e-5                            # of the largest logit, as above
    want = sorted(LoraSpec(rank=4, target_modules=targets).target_modules)
    assert adapted == want and config_targets == want
