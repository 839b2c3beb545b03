"""A sparse layer's experts at decode shapes on the CPU, in three forms: the per-expert
loop that reads the routing on the host for every expert hit (transformers'
``Qwen3MoeSparseMoeBlock``'s loop), the sorted form (one host read per layer) and the
dense form (no host read; every expert on every token). Each round times every form
once, interleaved, on the same inputs; the record keeps every round.

    python -m realign.bench.studies.moe_expert_forms --out benchmarks/moe/expert_forms_<date>.json

Shapes: the tiny MoE (make-tiny's moe_actor: width 64, 8 experts of 32, top 2) and one
layer of the GPU run's Qwen3-MoE (benchmarks/gpu/moe_grpo.sh: width 1024, 64 experts of
384, top 8), fp32, at decode steps of 16 and 64 rows. On a CPU nothing synchronises
with a device: the loop's cost is its Python and kernel calls per expert, the dense
form's its E / top_k times larger arithmetic. What the dense form is for (a GPU decode
step without host reads, captured as a CUDA graph) is not measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from realign.runtime.moe import route
from realign.runtime.moe_experts import experts_dense, experts_sorted

SHAPES = {"tiny": dict(h=64, n_experts=8, f=32, top_k=2),
          "gpu_run_layer": dict(h=1024, n_experts=64, f=384, top_k=8)}


def loop_form(x, weights, experts, fc1s, fc2s, n_experts):
    out = torch.zeros(x.shape[0], next(iter(fc2s.values())).shape[0], dtype=x.dtype)
    for e in torch.unique(experts).tolist():
        token, slot = torch.where(experts == e)
        gate, up = F.linear(x[token], fc1s[e]).chunk(2, dim=-1)
        out = out.index_add(0, token, F.linear(F.silu(gate) * up, fc2s[e])
                            * weights[token, slot, None])
    return out


FORMS = {"loop": loop_form, "sorted": experts_sorted,
         "dense": lambda x, w, e, f1, f2, n: experts_dense(x, w, e, f1, f2)}


def inputs(h, n_experts, f, top_k, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=g)
    router = torch.randn(n_experts, h, generator=g)
    fc1s = {e: torch.randn(2 * f, h, generator=g) * 0.02 for e in range(n_experts)}
    fc2s = {e: torch.randn(h, f, generator=g) * 0.02 for e in range(n_experts)}
    weights, experts = route(x, router, top_k, True)
    return x, weights, experts, fc1s, fc2s, n_experts


def time_s(fn, args, reps):
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return (time.perf_counter() - t0) / reps


def decoder_steps(rounds: int, rows: int = 16, reps: int = 20) -> dict:
    """One eager decode step of a whole tiny Qwen3-MoE decoder (make-tiny's moe_actor
    shape: 3 layers, the middle one dense) per form, the form chosen by patching the
    layer's choice (a one-rank gloo world)."""
    import socket

    import torch.distributed as dist

    import realign.runtime.moe as moe
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from planner.specs.model_spec import ModelSpec, MoeSpec
    from realign.runtime.device import init_device
    from realign.runtime.engines.decoder import StageDecoder
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.model import build_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    spec = ModelSpec(name="tiny-moe", family="qwen3_moe", n_layers=3, hidden=64, n_heads=4,
                     n_kv_heads=2, head_dim=32, ffn_hidden=96, vocab_size=256,
                     max_seq_len=256, qk_norm=True,
                     moe=MoeSpec(n_experts=8, top_k=2, expert_ffn_hidden=32,
                                 norm_topk_prob=True, dense_layers=(1,)))
    shard = build_model(spec, "lm", build_replica_groups(
        spec, DeviceMesh(first_gpu=0, n_gpus=1), Layout()), init_device("cpu", dtype="fp32"),
        seed=3)
    tokens = torch.randint(3, 200, (rows, 12), generator=torch.Generator().manual_seed(0))
    lengths = torch.full((rows,), 12)
    choose, sorted_form = moe.dense_experts, moe.experts_sorted
    patches = {"loop": (lambda t: False, loop_form),
               "sorted": (lambda t: False, sorted_form), "dense": (lambda t: True, sorted_form)}
    times: dict[str, list[float]] = {k: [] for k in patches}
    with torch.inference_mode():
        with torch.inference_mode(False):
            dec = StageDecoder(shard, 16, cache_rows=rows)
        x = dec.prefill(tokens, lengths).argmax(-1, keepdim=True)
        try:
            for r in range(rounds + 1):
                for k, (dense, sorted_fn) in patches.items():
                    moe.dense_experts, moe.experts_sorted = dense, sorted_fn
                    t = time_s(dec.eager_step, (x, lengths, 16, None), reps)
                    if r:                                   # round 0: warm-up
                        times[k].append(t)
        finally:
            moe.dense_experts, moe.experts_sorted = choose, sorted_form
    dist.destroy_process_group()
    return {"rows": rows, "reps_per_round": reps, "rounds_s": times,
            "median_s": {k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    cases = []
    with torch.no_grad():
        for name, shape in SHAPES.items():
            for tokens in (16, 64):
                ins = inputs(**shape, tokens=tokens)
                outs = {k: fn(*ins) for k, fn in FORMS.items()}            # warm-up
                diff = max(float((outs[k] - outs["loop"]).abs().max()) for k in outs)
                reps = 50 if name == "tiny" else 2
                rounds: dict[str, list[float]] = {k: [] for k in FORMS}
                for _ in range(args.rounds):
                    for k, fn in FORMS.items():
                        rounds[k].append(time_s(fn, ins, reps))
                med = {k: statistics.median(v) for k, v in rounds.items()}
                cases.append({"shape": name, **shape, "tokens": tokens, "reps_per_round": reps,
                              "max_abs_diff_to_loop": diff, "median_s": med, "rounds_s": rounds})
                print(f"{name:14s} T={tokens:3d}  " + "  ".join(
                    f"{k} {1e3 * v:8.3f} ms" for k, v in med.items()), flush=True)
    step = decoder_steps(args.rounds)
    print("tiny decoder step, 16 rows  " + "  ".join(
        f"{k} {1e3 * v:8.3f} ms" for k, v in step["median_s"].items()), flush=True)
    from realign.bench.machine import describe

    record = {"machine": describe(), "threads": torch.get_num_threads(),
              "load_avg_1_5_15_before": load_before, "load_avg_1_5_15_after": os.getloadavg(),
              "layer_cases": cases, "tiny_decoder_step": step}
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
