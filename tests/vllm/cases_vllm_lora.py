"""The LoRA replica of ``test_vllm_lora.py`` and what each rank of its 2-rank gloo
world runs: a TP 2 realign replica with adapters and its vLLM engine at TP 2, hosted
by TP rank 0."""
from __future__ import annotations

import json
from pathlib import Path

from planner.specs.lora import LoraSpec
from tests.vllm.cases_vllm_tp import PROMPTS, N, init_world, replica

__all__ = ["LORA", "N", "PROMPTS", "adapter_bytes", "lora_replica", "step_adapters", "tp2_lora"]

#: rank 8 on all seven projections, scale 2
LORA = LoraSpec(rank=8, alpha=16)


def fill_adapters(shard, seed: int, scale: float) -> None:
    """Add ``scale`` times seeded noise to every adapter (``B`` starts at zero: without
    this the adapters change nothing). A sharded factor's noise is drawn whole and
    sliced for the TP rank, a replicated one's drawn alike on every rank, so the TP
    ranks of a replica agree."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tp, rank = shard.groups.layout.tp, shard.groups.tp_rank
    with torch.no_grad():
        for name, prm in shard.module.named_parameters():
            if not name.endswith(("lora_A", "lora_B")):
                continue
            dim = getattr(prm, "partition_dim", -1) if getattr(
                prm, "tensor_model_parallel", False) else -1
            full = list(prm.shape)
            if dim >= 0:
                full[dim] *= tp
            noise = scale * torch.randn(full, generator=g)
            if dim >= 0:
                noise = noise.chunk(tp, dim)[rank]
            prm.add_(noise)


def lora_replica(model_dir: str, tp: int):
    """The small model at TP ``tp`` with :data:`LORA`'s adapters, filled."""
    from realign.runtime.lora import attach_lora

    shard = replica(model_dir, tp, 1)
    attach_lora(shard, LORA, seed=3)
    fill_adapters(shard, seed=0, scale=0.1)
    return shard


def step_adapters(shard) -> None:
    """A change of every adapter, as a training step makes."""
    fill_adapters(shard, seed=1, scale=0.1)


def adapter_bytes(shard) -> int:
    """The adapters' bytes in PEFT's layout (whole tensors)."""
    from planner.cost.lora_terms import adapter_params
    from planner.specs.layout import Layout

    elem = next(shard.module.parameters()).element_size()
    return int(elem * adapter_params(shard.spec, "lm", Layout(tp=1, pp=1, dp=1), shard.lora))


def tp2_lora(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """TP 2 vLLM with the TP 2 replica's adapters: greedy tokens against realign's own
    engine at TP 2 (and its base), before and after a change of the adapters."""
    import torch

    from realign.runtime.engines.generate import GenerateEngine
    from realign.runtime.engines.vllm_engine import VLLMEngine
    from realign.runtime.lora import adapters_disabled
    from realign.runtime.settings import SamplingParams, VLLMSettings

    torch.set_num_threads(1)
    init_world(rank, world, port)
    shard = lora_replica(model_dir, 2)
    engine = VLLMEngine(model_dir, VLLMSettings(kv_cache_gib=0.25, max_num_seqs=64),
                        torch.float32, max_model_len=64, tp=2,
                        host=shard.groups.tp_rank == 0, lora=LORA)
    p = SamplingParams(max_new_tokens=N, greedy=True)
    res: dict = {}
    try:
        res["bytes"] = engine.load(shard)
        v = engine.generate(shard, PROMPTS, p, pad_id=0)
        o = GenerateEngine(shard, pad_id=0).generate(PROMPTS, p)
        with adapters_disabled(shard):
            res["base"] = GenerateEngine(shard, pad_id=0).generate(PROMPTS, p).tokens.tolist()
        res["tokens"], res["own"] = v.tokens.tolist(), o.tokens.tolist()
        diff = float((v.logprobs - o.logprobs).abs().max())
        step_adapters(shard)
        engine.load(shard)
        v = engine.generate(shard, PROMPTS, p, pad_id=0)
        o = GenerateEngine(shard, pad_id=0).generate(PROMPTS, p)
        res["stepped"], res["own_stepped"] = v.tokens.tolist(), o.tokens.tolist()
        res["logprob_diff"] = max(diff, float((v.logprobs - o.logprobs).abs().max()))
        res["hosts"] = engine.llm is not None
        res["transport_made"] = engine.transport is not None
    finally:
        engine.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
