"""What each rank of a 2-rank gloo world runs for ``test_vllm_tp.py``: a realign
replica at TP 2 and
its vLLM engine at TP 2, hosted by TP rank 0 (vLLM's engine core and its two CPU
workers are that rank's children, so the ranks are started non-daemonic, as
``torch.multiprocessing.spawn`` does)."""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

PROMPTS = [[1, 5, 17, 40, 3, 42, 7], [1, 11, 12], [1, 50, 1, 2, 3], [1, 60, 61, 62, 63, 64]]
N = 24


def init_world(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))


def replica(model_dir: str, tp: int, dp: int):
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import load_hf_weights, spec_from_hf
    from realign.runtime.model import build_model

    spec = spec_from_hf(model_dir)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=tp * dp),
                                  Layout(tp=tp, pp=1, dp=dp))
    shard = build_model(spec, "lm", groups, init_device("cpu", dtype="fp32"), init_weights=False)
    load_hf_weights(shard, model_dir)
    return shard


def engine_for(shard, model_dir: str, max_model_len: int = 64):
    import torch

    from realign.runtime.engines.vllm_engine import VLLMEngine
    from realign.runtime.settings import VLLMSettings

    g = shard.groups
    return VLLMEngine(model_dir, VLLMSettings(kv_cache_gib=0.25, max_num_seqs=64),
                      torch.float32, max_model_len=max_model_len, tp=g.layout.tp,
                      host=g.tp_rank == 0)


def tp_parity(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """TP 2 vLLM fed in memory from a TP 2 replica: greedy tokens before a weight
    change, after it (against realign's own engine at TP 2 on the changed weights) and
    after restoring them; the bytes each load delivered."""
    import torch

    from realign.runtime.engines.generate import GenerateEngine
    from realign.runtime.settings import SamplingParams

    torch.set_num_threads(1)
    init_world(rank, world, port)
    shard = replica(model_dir, 2, 1)
    engine = engine_for(shard, model_dir)
    p = SamplingParams(max_new_tokens=N, greedy=True)
    res: dict = {}
    try:
        res["bytes"] = engine.load(shard)
        before = engine.generate(shard, PROMPTS, p, pad_id=0)
        res["before"] = before.tokens.tolist()
        res["before_logprobs"] = before.logprobs.tolist()
        saved = [prm.detach().clone() for prm in shard.module.parameters()]
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)     # replicated tensors stay equal
            for prm in shard.module.parameters():
                prm.add_(0.05 * torch.randn(prm.shape, generator=g))
        engine.load(shard)
        changed = engine.generate(shard, PROMPTS, p, pad_id=0)
        mine = GenerateEngine(shard, pad_id=0).generate(PROMPTS, p)
        res["changed"] = changed.tokens.tolist()
        res["own_changed"] = mine.tokens.tolist()
        res["changed_logprob_diff"] = float((changed.logprobs - mine.logprobs).abs().max())
        with torch.no_grad():
            for prm, old in zip(shard.module.parameters(), saved):
                prm.copy_(old)
        engine.load(shard)
        res["restored"] = engine.generate(shard, PROMPTS, p, pad_id=0).tokens.tolist()
        res["hosts"] = engine.llm is not None
    finally:
        engine.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


def spawn(fn, world: int, *args) -> None:
    """``fn(rank, world, port, *args)`` on ``world`` non-daemonic processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    mp.start_processes(fn, args=(world, port, *args), nprocs=world, join=True,
                       daemon=False, start_method="spawn")
