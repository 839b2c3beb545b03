"""LoRA on real gloo ranks: realign's adapters (in both of its forwards, at TP1 and TP2)
against PEFT's on the same base, initialisation and batch; scoring through them at TP2
and PP2. One 2-rank world (conftest)."""
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
