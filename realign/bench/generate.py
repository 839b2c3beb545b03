"""``realign bench generate``: realign's own engine against vLLM on the same work.

Run it in the vLLM environment (``make bench-generate``: ``.venv-vllm``). On one model
of tens of millions of parameters (``BENCH_ARCH``: 8 layers, width 512, heads of 64,
fp32; the tiny task's tokenizer) and the arithmetic task's prompts, in a one-rank gloo
world in this process (vLLM's engine core in its child process), it measures:

* **identity**: greedy tokens of realign's engine, vLLM (through realign) and
  ``transformers.generate`` on the same prompts;
* **throughput**, in interleaved rounds (every side once per round): generated tokens
  per second of vLLM alone (``LLM.generate`` on the prompts), realign with vLLM (the
  worker's call: the replica's weights into vLLM, then generation and realign's
  records) and realign's own engine (its waves: 1 and 4), with every response running
  to the cap (``fixed``) and with a stop token that ends responses with a long tail
  (``tail``: sampling at temperature 1; every side samples the same lengths' law);
* **weight update**: the seconds of loading the replica into vLLM against the plan's
  estimate of it (its ``weight_load`` term, with ``--profile``'s rates);
* **learning** (:mod:`realign.bench.generate_grpo`): the tiny GRPO
  (``experiments/tiny-grpo-vllm-cpu.yaml``) on each engine over ``--seeds`` seeds, from
  the random small actor and from its SFT warm start, its reward over the last five
  steps.

Everything it measured, and under what, goes into ``--out`` (JSON).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from realign.bench.machine import environment, load_snapshot

#: the benchmark's model: ~25M parameters, heads of 64 channels
BENCH_ARCH = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02)
REPO = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=64, help="prompts per call")
    p.add_argument("--gen-len", type=int, default=128, help="generated tokens at most")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--seeds", type=int, default=3, help="seeds of the GRPO comparison (0: skip)")
    p.add_argument("--steps", type=int, default=30, help="steps of each GRPO run")
    p.add_argument("--warm-steps", type=int, default=200, help="SFT steps of the warm "
                   "start of the second GRPO comparison")
    p.add_argument("--parts", default="throughput,grpo,grpo_warm", help="what to measure "
                   "(comma-separated): throughput (identity, throughput, weight update), "
                   "grpo (from the random small actor), grpo_warm (from its SFT)")
    p.add_argument("--profile", default=None, help="a realign profile table (prices the "
                   "weight update and the generation)")
    p.add_argument("--out", required=True, help="the JSON record")


def _world() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def bench_model(folder: Path) -> Path:
    from realign.assets.tiny import make_model

    return make_model(folder, "llama", "lm", seed=11, arch=BENCH_ARCH)


def _shard(folder: Path):
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.device import init_device
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import load_hf_weights, spec_from_hf
    from realign.runtime.model import build_model

    spec = spec_from_hf(folder)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1),
                                  Layout(tp=1, pp=1, dp=1))
    shard = build_model(spec, "lm", groups, init_device("cpu", dtype="fp32"), init_weights=False)
    load_hf_weights(shard, folder)
    return shard


def task_prompts(folder: Path, n: int) -> list[list[int]]:
    from realign.assets.tiny import math_problems
    from realign.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(folder))
    train, _ = math_problems(0)
    return [tok(row["prompt"])["input_ids"] for row in (train * (n // len(train) + 1))[:n]]


def _identity(shard, engine, folder: Path, prompts, n: int) -> dict:
    import torch
    import transformers

    from realign.runtime.engines.generate import GenerateEngine
    from realign.runtime.settings import SamplingParams

    p = SamplingParams(max_new_tokens=n, greedy=True)
    engine.load(shard)
    v = engine.generate(shard, prompts, p, pad_id=0)
    o = GenerateEngine(shard, pad_id=0).generate(prompts, p)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    same_hf = 0
    for i, q in enumerate(prompts):
        ids = torch.tensor([q])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        same_hf += out[0, len(q):].tolist() == v.tokens[i].tolist()
    return {"sequences": len(prompts), "tokens_each": n,
            "vllm_equal_own": int(sum(a == b for a, b in zip(v.tokens.tolist(),
                                                                o.tokens.tolist()))),
            "vllm_equal_transformers": int(same_hf),
            "max_logprob_diff_vllm_own": float((v.logprobs - o.logprobs).abs().max())}


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _throughput(shard, engine, prompts, n: int, rounds: int, stop: int) -> dict:
    """Per case and side: every round's seconds and generated tokens."""
    from realign.runtime.engines.generate import GenerateEngine
    from realign.runtime.engines.vllm_engine import vllm_sampling
    from realign.runtime.settings import SamplingParams

    cases = {"fixed": SamplingParams(max_new_tokens=n, seed=5),
             "tail": SamplingParams(max_new_tokens=n, seed=5, stop_token_ids=(stop,))}
    out: dict = {c: {} for c in cases}
    own = GenerateEngine(shard, pad_id=0)

    def vllm_alone(p):
        outs = engine.llm.generate([{"prompt_token_ids": q} for q in prompts],
                                   vllm_sampling(p, len(prompts), 0), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def realign_vllm(p):
        engine.load(shard)
        return int(engine.generate(shard, prompts, p, pad_id=0).lengths.sum())

    sides = {"vllm_alone": vllm_alone, "realign_vllm": realign_vllm,
             "own_1wave": lambda p: int(own.generate(prompts, p, waves=1).lengths.sum()),
             "own_4waves": lambda p: int(own.generate(prompts, p, waves=4).lengths.sum())}
    for p in cases.values():                # one untimed run of each side
        for fn in sides.values():
            fn(p)
    for r in range(rounds):
        for case, p in cases.items():
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                fn = sides[side]
                s, tokens = _timed(lambda fn=fn, p=p: fn(p))
                out[case].setdefault(side, []).append({"s": s, "tokens": tokens,
                                                       "load": load_snapshot()["loadavg_1m"]})
    return out


def _load_times(shard, engine, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        s, _n = _timed(lambda: engine.load(shard))
        times.append(s)
    return times


def _estimate(shard, profile: str | None, prompts, n: int, tail_mean: float) -> dict:
    """The plan's price of the weight update, and of each case's call on vLLM (weight
    load included) and on realign's engine in one wave (the tail priced as a censored
    geometric of the mean length vLLM's responses had)."""
    from planner.cost.cost_config import CostModelConfig
    from planner.cost.cost_model import CostModel
    from planner.cost.profile import ProfileTable
    from planner.graph.dataflow import MFC
    from planner.graph.lengths import GenLengths
    from planner.specs.cluster import ClusterSpec, resolve_device
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh

    table = ProfileTable.load(profile) if profile else None
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("cpu")),
                   CostModelConfig(param_dtype_bytes=4, generate_engine="auto"), table)
    out: dict = {"profile": profile}
    for case, lengths in (("fixed", None), ("tail", GenLengths(max_len=n, mean=tail_mean))):
        mfc = MFC(name="bench.generate", role="actor", kind="generate", n_seqs=len(prompts),
                  prompt_len=max(len(q) for q in prompts), gen_len=n, input_keys=("x",),
                  output_keys=("y",), lengths=lengths)
        for engine, side in (("vllm", "realign_vllm"), ("own", "own_1wave")):
            c = cm.mfc_cost(mfc, shard.spec, "lm", DeviceMesh(first_gpu=0, n_gpus=1),
                            Layout(tp=1, pp=1, dp=1), 1, engine=engine)
            out[f"{case}.{side}_s"] = c.time_s
            if engine == "vllm":
                out["weight_load_s"] = c.terms_s["weight_load"]
    return out


def summarise(rec: dict) -> dict:
    """The headline numbers: medians (and min-max) over the rounds."""
    def rate(rows):
        tps = [x["tokens"] / x["s"] for x in rows]
        return {"median_tokens_per_s": statistics.median(tps), "min": min(tps), "max": max(tps)}
    out: dict = {}
    for key in ("grpo", "grpo_warm"):
        if rec.get(key):
            out[f"{key}_final_reward"] = {e: [x["final_reward"] for x in runs]
                                          for e, runs in rec[key].items()}
    if "throughput" not in rec:
        return out
    for case, sides in rec["throughput"].items():
        r = {side: rate(rows) for side, rows in sides.items()}
        med = {k: v["median_tokens_per_s"] for k, v in r.items()}
        per_round = [a["tokens"] / a["s"] / (b["tokens"] / b["s"])
                     for a, b in zip(sides["realign_vllm"], sides["vllm_alone"])]
        own_ratio = [a["tokens"] / a["s"] / (b["tokens"] / b["s"])
                     for a, b in zip(sides["own_1wave"], sides["vllm_alone"])]
        out[case] = {"sides": r, "realign_vllm_over_vllm_alone": statistics.median(per_round),
                     "realign_vllm_over_vllm_alone_range": [min(per_round), max(per_round)],
                     "own_1wave_over_vllm_alone": statistics.median(own_ratio),
                     "own_1wave_over_vllm_alone_range": [min(own_ratio), max(own_ratio)],
                     "own_4waves_over_vllm_alone": med["own_4waves"] / med["vllm_alone"],
                     "mean_tokens_per_sequence": statistics.fmean(
                         x["tokens"] for x in sides["vllm_alone"]) / rec["prompts"]}
    for case in rec["throughput"]:
        for side in ("realign_vllm", "own_1wave"):
            measured = statistics.median(x["s"] for x in rec["throughput"][case][side])
            est = rec["estimate"][f"{case}.{side}_s"]
            out[case][f"{side}_estimate_s"] = est
            out[case][f"{side}_measured_s"] = measured
            out[case][f"{side}_estimate_over_measured"] = est / measured
    loads = rec["weight_load_s"]
    out["weight_load"] = {"median_s": statistics.median(loads), "min_s": min(loads),
                          "max_s": max(loads), "estimate_s": rec["estimate"]["weight_load_s"],
                          "measured_over_estimate": statistics.median(loads)
                          / rec["estimate"]["weight_load_s"]}
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from realign.bench.generate_grpo import grpo_runs

    torch.set_num_threads(1)
    parts = set(args.parts.split(","))
    rec: dict = {"environment": environment(), "load_before": load_snapshot(),
                 "arch": BENCH_ARCH, "prompts": args.prompts, "gen_len": args.gen_len,
                 "rounds": args.rounds, "threads": 1, "dtype": "fp32", "parts": sorted(parts)}
    with tempfile.TemporaryDirectory(prefix="realign-bench-generate-") as tmp:
        if "throughput" in parts:
            rec.update(_engines(args, Path(tmp)))
        if "grpo" in parts and args.seeds:
            rec["grpo"] = grpo_runs(args.seeds, args.steps, Path(tmp) / "grpo", warm_steps=0)
        if "grpo_warm" in parts and args.seeds:
            rec["grpo_warm"] = grpo_runs(args.seeds, args.steps, Path(tmp) / "warm",
                                         warm_steps=args.warm_steps)
    rec["load_after"] = load_snapshot()
    rec["summary"] = summarise(rec)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec["summary"], indent=1))
    return 0


def _engines(args: argparse.Namespace, tmp: Path) -> dict:
    """Identity, throughput, weight update and the plan's prices (one vLLM engine)."""
    import torch

    from realign.assets.tiny import EOS_ID
    from realign.runtime.engines.vllm_engine import VLLMEngine
    from realign.runtime.settings import VLLMSettings

    _world()
    rec: dict = {}
    folder = bench_model(tmp / "bench")
    shard = _shard(folder)
    rec["params"] = sum(p.numel() for p in shard.module.parameters())
    prompts = task_prompts(folder, args.prompts)
    engine = VLLMEngine(folder, VLLMSettings(kv_cache_gib=2, max_num_seqs=256),
                        torch.float32, max_model_len=args.gen_len + 32)
    try:
        rec["identity"] = _identity(shard, engine, folder, prompts[:16], 64)
        print("identity", rec["identity"], file=sys.stderr)
        rec["stop_token"] = EOS_ID
        rec["throughput"] = _throughput(shard, engine, prompts, args.gen_len, args.rounds,
                                        EOS_ID)
        rec["weight_load_s"] = _load_times(shard, engine, 2 * args.rounds)
    finally:
        engine.close()
    tail = rec["throughput"]["tail"]["vllm_alone"]
    rec["estimate"] = _estimate(shard, args.profile, prompts, args.gen_len,
                                statistics.fmean(x["tokens"] for x in tail) / len(prompts))
    return rec
