"""realign's LoRA trains PEFT's parameter count: PEFT's own models (``get_peft_model`` on
tiny LLaMA, Qwen2 and Qwen3 bases) counted against :meth:`LoraSpec.total_params`, for
several target sets including subsets of the fused q/k/v and gate/up layers. (The
distributed tests check that a replica's trained parameters are this count.)"""
from __future__ import annotations

import pytest

from planner.specs.lora import LoraSpec

pytestmark = pytest.mark.torch

TARGET_SETS = [["all-linear"], ["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"],
               ["k_proj", "gate_proj"], ["up_proj", "down_proj"], ["linear_qkv", "linear_fc1"]]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_trained_parameters_equal_pefts(tiny_models, kind):
    from peft import LoraConfig, get_peft_model
    from tiny_hf import hf_model

    from realign.runtime.hf_checkpoint import spec_from_hf

    path = tiny_models[kind]
    spec = spec_from_hf(path)
    for rank in (2, 8):
        for targets in TARGET_SETS:
            lora = LoraSpec(rank=rank, target_modules=targets)
            peft = get_peft_model(hf_model(path), LoraConfig(
                r=rank, target_modules=list(lora.target_modules)))
            n_peft = sum(p.numel() for p in peft.parameters() if p.requires_grad)
            assert lora.total_params(spec) == n_peft, (kind, rank, targets)
            if len(lora.parts("linear_qkv")) + len(lora.parts("linear_fc1")) > 2:
                assert LoraSpec(rank=rank, target_modules=targets,
                                shared_a=True).total_params(spec) < n_peft
