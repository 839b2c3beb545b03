"""vLLM inside realign on CPU: the weight update through a safetensors file against in
memory (shared-memory buckets), and vLLM at TP 2 against TP 1 (tokens/s, greedy
parity). Run in the vLLM environment:

    .venv-vllm/bin/python -m realign.bench.studies.generate_vllm_weights_tp --out FILE.json

The model is ``realign bench generate``'s (``BENCH_ARCH``: a random LLaMA of 25.3 M
parameters, fp32). Weight update: ``--rounds`` interleaved rounds, the two routes in
alternating order, each timed from the replica's parameters to vLLM's (the file route:
whole tensors to Hugging Face names, a safetensors file in /dev/shm, vLLM's
``reload_weights`` from it; in memory: :func:`realign.runtime.engines.vllm_weights.
push_weights` through shared memory). TP: a world of ``tp`` ranks (a realign replica at
that TP, its vLLM engine at that TP hosted by rank 0, its CPU workers bound one per
core), greedy generation of ``--prompts`` prompts, ``--gen-len`` tokens each,
``--gen-rounds`` timed rounds after one warm-up. Every raw time is written out, with the
machine's load.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from realign.bench.plans import spread

#: the vLLM engines' settings (``VLLMSettings``): each engine's KV cache, its concurrency
KV_CACHE_GIB = 1
MAX_NUM_SEQS = 256


def init_world(rank: int, world: int, port: int) -> None:
    """This process as ``rank`` of a gloo world of ``world`` ranks (its store on ``port``)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=900))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))


def bench_replica(model_dir: str, tp: int):
    """This rank's shard of a realign replica of ``model_dir`` at TP ``tp`` (PP 1, DP 1)."""
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import load_hf_weights, spec_from_hf
    from realign.runtime.model import build_model

    spec = spec_from_hf(model_dir)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=tp),
                                  Layout(tp=tp, pp=1, dp=1))
    shard = build_model(spec, "lm", groups, init_device("cpu", dtype="fp32"), init_weights=False)
    load_hf_weights(shard, model_dir)
    return shard


def bench_engine(shard, model_dir: str, max_model_len: int):
    """realign's vLLM engine for ``shard``'s replica (hosted by its TP rank 0)."""
    import torch

    from realign.runtime.engines.vllm_engine import VLLMEngine
    from realign.runtime.settings import VLLMSettings

    g = shard.groups
    return VLLMEngine(model_dir, VLLMSettings(kv_cache_gib=KV_CACHE_GIB, max_num_seqs=MAX_NUM_SEQS),
                      torch.float32, max_model_len=max_model_len, tp=g.layout.tp,
                      host=g.tp_rank == 0)


def _hf_of(shard) -> dict:
    """The file route's first half: the replica's whole tensors under HF names (TP 1)."""
    from realign.runtime.engines.vllm_weights import group_tensors, weight_groups
    from realign.runtime.model import logical_shards

    local = logical_shards(shard, shard.groups.layout, 0)
    return {n: t.cpu() for grp in weight_groups(shard)
            for n, t in group_tensors(shard, grp, local)}


def weight_update(rank: int, world: int, port: int, model_dir: str, out: str,
                  rounds: int) -> None:
    import torch

    torch.set_num_threads(1)
    init_world(rank, world, port)
    shard = bench_replica(model_dir, 1)
    engine = bench_engine(shard, model_dir, 128)
    res: dict = {"file_s": [], "memory_s": [], "order": []}
    try:
        engine.load(shard)
        engine.load_files(_hf_of(shard))                      # warm both routes
        for r in range(rounds):
            order = ("file", "memory") if r % 2 == 0 else ("memory", "file")
            res["order"].append(list(order))
            for route in order:
                t0 = time.perf_counter()
                nbytes = engine.load(shard) if route == "memory" else \
                    engine.load_files(_hf_of(shard))
                res[f"{route}_s"].append(time.perf_counter() - t0)
                res["bytes"] = nbytes
            res.setdefault("load1", []).append(os.getloadavg()[0])
    finally:
        engine.close()
    Path(out, "weights.json").write_text(json.dumps(res))


def timed_generate(rank: int, world: int, port: int, model_dir: str, out: str,
                   prompts: int, gen_len: int, rounds: int) -> None:
    import torch

    from realign.runtime.settings import SamplingParams

    torch.set_num_threads(1)
    init_world(rank, world, port)
    shard = bench_replica(model_dir, world)
    engine = bench_engine(shard, model_dir, 128)
    g = torch.Generator().manual_seed(7)
    rows = [[1, *r] for r in torch.randint(3, 70, (prompts, 6), generator=g).tolist()]
    p = SamplingParams(max_new_tokens=gen_len, greedy=True)
    res: dict = {"tp": world, "rounds_s": [], "load1": []}
    try:
        engine.load(shard)
        engine.generate(shard, rows[:4], p, pad_id=0)
        for _ in range(rounds):
            t0 = time.perf_counter()
            gen = engine.generate(shard, rows, p, pad_id=0)
            res["rounds_s"].append(time.perf_counter() - t0)
            res["load1"].append(os.getloadavg()[0])
        res["tokens"] = gen.tokens.tolist()
        res["generated"] = int(gen.lengths.sum())
    finally:
        engine.close()
    if rank == 0:
        Path(out, f"tp{world}.json").write_text(json.dumps(res))


def spawn_world(fn, world: int, *args) -> None:
    """``fn(rank, world, port, *args)`` in ``world`` spawned processes; returns when all end."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(fn, args=(world, port, *args), nprocs=world, join=True,
                       daemon=False, start_method="spawn")


def _summary(xs: list[float]) -> dict:
    return {**spread(xs), "all": xs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--gen-rounds", type=int, default=3)
    ap.add_argument("--parts", default="weights,tp")
    args = ap.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    import vllm

    from realign.assets.tiny import make_model
    from realign.bench.generate import BENCH_ARCH
    from realign.bench.machine import describe

    rec: dict = {"machine": {**describe(), "vllm": vllm.__version__},
                 "arch": BENCH_ARCH, "args": vars(args), "load1_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="realign-vllm-bench-") as tmp:
        model = str(make_model(Path(tmp) / "bench", "llama", "lm", seed=11, arch=BENCH_ARCH))
        parts = args.parts.split(",")
        if "weights" in parts:
            spawn_world(weight_update, 1, model, tmp, args.rounds)
            w = json.loads((Path(tmp) / "weights.json").read_text())
            rec["weight_update"] = {"bytes": w["bytes"], "file": _summary(w["file_s"]),
                                    "memory": _summary(w["memory_s"]), "order": w["order"],
                                    "load1": w["load1"],
                                    "file_over_memory": [f / m for f, m in
                                                         zip(w["file_s"], w["memory_s"])]}
        if "tp" in parts:
            runs: dict[int, list[dict]] = {}
            for tp in (1, 2, 1, 2):                # interleaved: TP 1, TP 2, twice
                spawn_world(timed_generate, tp, model, tmp, args.prompts, args.gen_len,
                            args.gen_rounds)
                r = json.loads((Path(tmp) / f"tp{tp}.json").read_text())
                runs.setdefault(tp, []).append(r)
            rec["tp"] = {}
            for tp, rs in runs.items():
                times = [t for r in rs for t in r["rounds_s"]]
                rec["tp"][f"tp{tp}"] = {
                    "tokens_per_s": _summary([rs[0]["generated"] / t for t in times]),
                    "generated": rs[0]["generated"], "load1": [x for r in rs for x in r["load1"]]}
            rec["tp"]["greedy_equal_rows"] = sum(
                a == b for a, b in zip(runs[1][0]["tokens"], runs[2][0]["tokens"]))
            rec["tp"]["rows"] = len(runs[1][0]["tokens"])
    rec["load1_end"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: v for k, v in rec.items() if k in ("weight_update", "tp")},
                     indent=1)[:4000])


if __name__ == "__main__":
    main()
