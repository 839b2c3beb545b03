"""realign with vLLM against vLLM alone, at TP 1 and TP 2 on CPU: tokens per second of
each side in interleaved rounds, and their ratio (issue 45: realign with vLLM at 90 % or
more of standalone vLLM's throughput). Run in the vLLM environment:

    .venv-vllm/bin/python -m realign.bench.studies.generate_vllm_standalone_ratio --out FILE.json

The model is ``realign bench generate``'s (``BENCH_ARCH``: a random LLaMA of 25.3 M
parameters, fp32, its checkpoint made by ``bench_model``); the prompts are the tiny
task's (``task_prompts``), ``--prompts`` of them; greedy, ``--gen-len`` tokens each, no
stop token (every response runs to the cap). Per TP of ``--tps``, one spawned gloo
world of TP ranks holds both sides at once:

* **realign**: a replica at that TP and realign's vLLM engine for it (``VLLMEngine``,
  hosted by TP rank 0; at TP 2 its two CPU workers bound one per core). A round is
  realign's call: the in-memory weight update (``VLLMEngine.load``, every rank), timed
  apart, then ``VLLMEngine.generate`` (vLLM's generation, realign's records, their
  broadcast to the other TP rank).
* **standalone**: a second ``vllm.LLM`` on the same checkpoint, built by rank 0 with the
  engine arguments realign gives its own (:func:`standalone_args`: fp32, eager, the same
  KV cache, ``max_num_seqs`` and ``max_model_len``, no prefix caching, the executor of
  that TP) in the same environment (``child_env``: one OpenMP thread per vLLM worker,
  ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` at TP 2), driven by ``LLM.generate`` alone with
  the same vLLM ``SamplingParams`` (``vllm_sampling``). The other rank waits at a
  barrier meanwhile.

One untimed call of each side, then ``--rounds`` rounds, each side once per round, the
order alternating (:func:`side_order`). After each side the ranks sleep ``--settle-s``:
vLLM's multi-process workers poll their queue busily for a second after their last
message, and the pause keeps the idle engine's polling out of the other side's time.
Every round's raw times, tokens, order and 1-minute load are written out.

The ratio of a round is realign's tokens per second over standalone's (:func:`round_ratios`):
``with_update`` counts the weight update in realign's time (the definition of
``realign bench generate``'s record of 2026-11-27, 0.955 at TP 1: what a realign call
costs, so the number the issue's "again" compares with), ``generation_only`` leaves it
out (the wrapper's records and broadcast alone). Per TP: median and min-max of the
per-round ratios (:func:`summarize_tp`), and greedy parity (sequences equal between the
sides, and between TP 1 and TP 2).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from realign.bench.plans import spread
from realign.bench.studies.generate_vllm_weights_tp import (
    KV_CACHE_GIB,
    MAX_NUM_SEQS,
    bench_engine,
    bench_replica,
    init_world,
    spawn_world,
)

SIDES = ("realign", "standalone")
GIB = 2 ** 30


def side_order(round_index: int) -> list[str]:
    """The sides' order in a round: realign first in even rounds.

    Example: 0 -> ``["realign", "standalone"]``, 1 -> ``["standalone", "realign"]``."""
    return list(SIDES) if round_index % 2 == 0 else list(reversed(SIDES))


def standalone_args(tp: int, max_model_len: int, enforce_eager: bool) -> dict:
    """``vllm.LLM``'s keyword arguments for the standalone side, besides the model and
    dtype: those realign's ``VLLMEngine`` passes on CPU, less its worker extension.

    Example: TP 2 -> ``tensor_parallel_size=2``, ``distributed_executor_backend="mp"``."""
    return dict(seed=0, tensor_parallel_size=tp,
                distributed_executor_backend="uni" if tp == 1 else "mp",
                enforce_eager=enforce_eager, skip_tokenizer_init=True,
                max_model_len=max_model_len, max_num_seqs=MAX_NUM_SEQS,
                kv_cache_memory_bytes=int(KV_CACHE_GIB * GIB), enable_prefix_caching=False)


def round_ratios(row: dict) -> dict:
    """realign's tokens/s over standalone's in one round, with and without the weight
    update in realign's time.

    Example: realign 0.1 s update + 0.9 s generating 100 tokens, standalone 100 tokens
    in 0.9 s: ``with_update`` 0.9, ``generation_only`` 1.0."""
    rl, st = row["realign"], row["standalone"]
    alone = st["tokens"] / st["s"]
    return {"with_update": rl["tokens"] / (rl["load_s"] + rl["generate_s"]) / alone,
            "generation_only": rl["tokens"] / rl["generate_s"] / alone}


def equal_rows(a: list[list[int]], b: list[list[int]]) -> int:
    """How many sequences of ``a`` equal ``b``'s at the same index."""
    return sum(x == y for x, y in zip(a, b))


def summarize_tp(res: dict) -> dict:
    """One TP's numbers from its raw rounds (``res["rounds"]``, as :func:`side_by_side`
    writes them): the ratios' median and min-max, each side's tokens/s, the weight
    update's seconds, the load, and greedy parity between the sides."""
    rows = res["rounds"]
    ratios = [round_ratios(r) for r in rows]
    rl = [r["realign"] for r in rows]
    st = [r["standalone"] for r in rows]
    return {
        "ratio_with_update": spread([x["with_update"] for x in ratios]),
        "ratio_generation_only": spread([x["generation_only"] for x in ratios]),
        "per_round": ratios,
        "tokens_per_s": {
            "realign_with_update": spread([x["tokens"] / (x["load_s"] + x["generate_s"])
                                           for x in rl]),
            "realign_generation_only": spread([x["tokens"] / x["generate_s"] for x in rl]),
            "standalone": spread([x["tokens"] / x["s"] for x in st])},
        "weight_update_s": spread([x["load_s"] for x in rl]),
        "load1": spread([r["load1"] for r in rows]),
        "greedy_equal_rows": equal_rows(res["tokens"]["realign"], res["tokens"]["standalone"]),
        "rows": len(res["tokens"]["standalone"])}


def standalone_llm(model_dir: str, tp: int, max_model_len: int):
    """The standalone ``vllm.LLM`` (see the module docstring) and its arguments."""
    import torch
    from vllm import LLM

    from realign.runtime.engines.vllm_engine import child_env
    from realign.runtime.engines.vllm_routing import vllm_eager

    args = standalone_args(tp, max_model_len, vllm_eager("cpu"))
    threads = torch.get_num_threads()
    with child_env("cpu", list(range(tp)), tp):
        llm = LLM(model=model_dir, dtype=torch.float32, **args)
    torch.set_num_threads(threads)          # vLLM lowers the caller's threads
    return llm, args


def side_by_side(rank: int, world: int, port: int, model_dir: str, out: str, prompts_n: int,
                 gen_len: int, rounds: int, settle_s: float) -> None:
    """One TP's world: both sides, every round (see the module docstring); rank 0
    writes ``tp<world>.json`` in ``out``."""
    import torch
    import torch.distributed as dist

    from realign.bench.generate import task_prompts
    from realign.runtime.engines.vllm_engine import CLOSE_TIMEOUT_S, vllm_sampling
    from realign.runtime.settings import SamplingParams

    torch.set_num_threads(1)
    init_world(rank, world, port)
    prompts = task_prompts(Path(model_dir), prompts_n)
    max_model_len = max(len(q) for q in prompts) + gen_len + 8
    shard = bench_replica(model_dir, world)
    engine = bench_engine(shard, model_dir, max_model_len)
    try:                                  # the engine closed however the standalone fails
        llm, args = standalone_llm(model_dir, world, max_model_len) if rank == 0 else (None, {})
    except BaseException:
        engine.close()
        raise
    p = SamplingParams(max_new_tokens=gen_len, greedy=True)
    requests = [{"prompt_token_ids": q} for q in prompts]

    def realign() -> tuple[dict, list[list[int]]]:
        t0 = time.perf_counter()
        nbytes = engine.load(shard)
        t1 = time.perf_counter()
        gen = engine.generate(shard, prompts, p, pad_id=0)
        t2 = time.perf_counter()
        rows = [t[:n] for t, n in zip(gen.tokens.tolist(), gen.lengths.tolist())]
        return ({"load_s": t1 - t0, "generate_s": t2 - t1, "tokens": int(gen.lengths.sum()),
                 "bytes": nbytes}, rows)

    def standalone() -> tuple[dict, list[list[int]]]:
        if llm is None:
            dist.barrier()
            return {}, []
        t0 = time.perf_counter()
        outs = llm.generate(requests, vllm_sampling(p, len(prompts), 0), use_tqdm=False)
        s = time.perf_counter() - t0
        dist.barrier()
        rows = [list(o.outputs[0].token_ids) for o in outs]
        return {"s": s, "tokens": sum(len(r) for r in rows)}, rows

    sides = {"realign": realign, "standalone": standalone}
    res: dict = {"tp": world, "prompts": len(prompts), "gen_len": gen_len,
                 "max_model_len": max_model_len, "standalone_args": args,
                 "settle_s": settle_s, "rounds": [], "tokens": {}}
    try:
        for side in SIDES:                          # one untimed call of each
            sides[side]()
        for r in range(rounds):
            row: dict = {"order": side_order(r), "load1": os.getloadavg()[0]}
            for side in row["order"]:
                time.sleep(settle_s)
                row[side], res["tokens"][side] = sides[side]()
            res["rounds"].append(row)
    finally:
        engine.close()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown(timeout=CLOSE_TIMEOUT_S)
    if rank == 0:
        Path(out, f"tp{world}.json").write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON record")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per TP")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per call")
    ap.add_argument("--gen-len", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--tps", default="1,2", help="the TPs, comma-separated (1, 2)")
    ap.add_argument("--settle-s", type=float, default=1.5,
                    help="pause before each side (the idle engine's workers stop polling)")
    args = ap.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    import vllm

    from realign.bench.generate import BENCH_ARCH, bench_model
    from realign.bench.machine import describe

    t0 = time.perf_counter()
    rec: dict = {"machine": {**describe(), "vllm": vllm.__version__}, "arch": BENCH_ARCH,
                 "args": vars(args), "kv_cache_gib": KV_CACHE_GIB, "max_num_seqs": MAX_NUM_SEQS,
                 "threads": 1, "dtype": "fp32", "headline": "ratio_with_update",
                 "load1_start": os.getloadavg()[0], "tp": {}}
    with tempfile.TemporaryDirectory(prefix="realign-vllm-ratio-") as tmp:
        model = str(bench_model(Path(tmp) / "bench"))
        raw: dict[int, dict] = {}
        for tp in (int(t) for t in args.tps.split(",")):
            spawn_world(side_by_side, tp, model, tmp, args.prompts, args.gen_len, args.rounds,
                        args.settle_s)
            raw[tp] = json.loads((Path(tmp) / f"tp{tp}.json").read_text())
            rec["tp"][f"tp{tp}"] = {"raw": raw[tp], "summary": summarize_tp(raw[tp])}
        if 1 in raw and 2 in raw:
            rec["greedy_equal_rows_tp1_tp2"] = equal_rows(raw[1]["tokens"]["realign"],
                                                          raw[2]["tokens"]["realign"])
    rec["load1_end"] = os.getloadavg()[0]
    rec["wall_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=1))
    brief = {k: {m: v["summary"][m] for m in ("ratio_with_update", "ratio_generation_only",
                                              "tokens_per_s", "greedy_equal_rows", "rows")}
             for k, v in rec["tp"].items()}
    print(json.dumps({**brief, "wall_s": rec["wall_s"]}, indent=1))


if __name__ == "__main__":
    main()
