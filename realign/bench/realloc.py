"""``realign bench realloc``: parameter reallocation on 4 CPU gloo ranks.

For each case (source -> destination placement of one model on ranks 0..3) it
measures the planned executor (:func:`realign.realloc.executor.reallocate`) and the
naive way (:func:`realign.realloc.naive.naive_reallocate`: gather the full weights on
one rank, send them whole to every destination), and reports bytes moved, the lower
bound (bytes each destination rank lacks locally, summed), the planner's priced bytes
(:mod:`planner.cost.realloc_cost`), median and raw times, and the speed-up. Every result
is checked bit for bit against the reference weights.

Timing: per run, all ranks meet at a barrier, each times its own call, and the run's
time is the slowest rank's; ``--warmup`` runs are discarded, ``--repeats`` kept.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from planner.cost.transfer import Placement
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec, resolve_model
from planner.specs.param_layout import all_tensors

WORLD = 4
#: The default benchmark model: ~32M parameters (128 MB in float32), LLaMA-shaped
#: with grouped-query attention; TP 1/2/4 and PP 1/2/4 all divide it.
BENCH_MODEL = ModelSpec(name="bench-llama-32m", n_layers=8, hidden=512, n_heads=8,
                        n_kv_heads=4, ffn_hidden=1408, vocab_size=8192)

# name -> (src (first, n, tp, pp, dp), dst (first, n, tp, pp, dp))
CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "tp1dp4->tp4": ((0, 4, 1, 1, 4), (0, 4, 4, 1, 1)),
    "tp4->tp1dp4": ((0, 4, 4, 1, 1), (0, 4, 1, 1, 4)),
    "tp4->pp4": ((0, 4, 4, 1, 1), (0, 4, 1, 4, 1)),
    "pp4->tp4": ((0, 4, 1, 4, 1), (0, 4, 4, 1, 1)),
    "tp2pp2->tp1pp4": ((0, 4, 2, 2, 1), (0, 4, 1, 4, 1)),
    "tp2dp2->tp1pp2dp2": ((0, 4, 2, 1, 2), (0, 4, 1, 2, 2)),
    "tp2pp2->tp2dp2": ((0, 4, 2, 2, 1), (0, 4, 2, 1, 2)),
    "g01:tp2->g23:tp2 (disjoint)": ((0, 2, 2, 1, 1), (2, 2, 2, 1, 1)),
    "g01:tp2->g23:pp2 (disjoint)": ((0, 2, 2, 1, 1), (2, 2, 1, 2, 1)),
    "g0:tp1->g0-3:tp2dp2 (nested)": ((0, 1, 1, 1, 1), (0, 4, 2, 1, 2)),
    "g0-3:tp2pp2->g23:tp2 (overlap)": ((0, 4, 2, 2, 1), (2, 2, 2, 1, 1)),
    "tp2pp2->tp2pp2 (equal)": ((0, 4, 2, 2, 1), (0, 4, 2, 2, 1)),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model preset or HF config.json (default: a built-in 32M LLaMA)")
    p.add_argument("--head", choices=("lm", "value"), default="lm")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case and method")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per case and method")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--cases", nargs="*", default=None, metavar="NAME",
                   help=f"subset of cases (default all): {', '.join(CASES)}")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")


def _placement(t: tuple[int, ...]) -> Placement:
    first, n, tp, pp, dp = t
    return Placement(DeviceMesh(first_gpu=first, n_gpus=n), Layout(tp=tp, pp=pp, dp=dp))


def _describe(t: tuple[int, ...]) -> str:
    first, n, tp, pp, dp = t
    return f"gpus {first}-{first + n - 1} TP{tp}·PP{pp}·DP{dp}"


# ---- rank side ---------------------------------------------------------------------

def _rank_setup(ctx, spec_json: str, head: str) -> dict:
    import torch

    from realign.realloc.synthetic import full_weights
    spec = ModelSpec.model_validate_json(spec_json)
    ctx.store.clear()
    ctx.store.update(spec=spec, head=head, full=full_weights(spec, head, seed=0))
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "pid": os.getpid()}


def _rank_case(ctx, src_t: tuple, dst_t: tuple, warmup: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from realign.realloc.executor import allocate_shards, reallocate
    from realign.realloc.naive import naive_reallocate
    from realign.realloc.synthetic import shards_of

    spec, head, full = ctx.store["spec"], ctx.store["head"], ctx.store["full"]
    gpu = dist.get_rank()
    src, dst = _placement(src_t), _placement(dst_t)
    a = shards_of(full, spec, head, src, gpu)
    want = shards_of(full, spec, head, dst, gpu)

    def planned(b):
        s = reallocate(spec, head, src, dst, a, b, dtype=torch.float32, gpus_per_node=WORLD)
        return s.bytes_received

    def naive(b):
        return naive_reallocate(spec, head, src, dst, a, b, dtype=torch.float32)

    out: dict[str, Any] = {"gpu": gpu}
    for name, fn in (("planned", planned), ("naive", naive)):
        b = allocate_shards(spec, head, dst, gpu, torch.float32)
        times, received = [], None
        for i in range(warmup + repeats):
            for t in b.values():
                t.fill_(float("nan"))
            dist.barrier()
            t0 = time.perf_counter()
            received = fn(b)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
        exact = all(torch.equal(b[n].view(torch.int32), want[n].view(torch.int32)) for n in want)
        out[name] = {"times_s": times, "bytes_received": received, "bit_exact": exact}
    return out


# ---- driver ------------------------------------------------------------------------

def _environment(threads: int) -> dict:
    def ver(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "torch": ver("torch"), "megatron-core": ver("megatron-core"),
            "realign": ver("realign"), "backend": "gloo (127.0.0.1 TCP)",
            "ranks": WORLD, "threads_per_rank": threads}


def run(args: argparse.Namespace) -> int:
    from planner.cost.realloc_cost import ReallocModel, realloc_recv_send
    from realign.errors import UserError
    from realign.realloc.checks import check_reallocation, lower_bound_bytes
    from realign.runtime.local_world import LocalWorld

    spec = resolve_model(args.model) if args.model else BENCH_MODEL
    names = args.cases or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise UserError(f"unknown case(s) {unknown}; choose from {list(CASES)}", field="--cases")
    if args.repeats < 1 or args.warmup < 0:
        raise UserError("--repeats must be >= 1 and --warmup >= 0", field="--repeats")
    for n in names:  # bad input fails here, before any process starts
        check_reallocation(spec, args.head, _placement(CASES[n][0]), _placement(CASES[n][1]),
                           WORLD)

    dtype_bytes = 4
    rm = ReallocModel.of(spec, args.head, dtype_bytes)
    t_start = time.time()
    with LocalWorld(WORLD, threads=args.threads, timeout_s=600) as world:
        rank_info = world.run(_rank_setup, spec.model_dump_json(), args.head)
        rows = []
        for n in names:
            s_t, d_t = CASES[n]
            src, dst = _placement(s_t), _placement(d_t)
            res = world.run(_rank_case, s_t, d_t, args.warmup, args.repeats)
            bound = sum(lower_bound_bytes(spec, args.head, src, dst, dtype_bytes).values())
            acc = realloc_recv_send(rm, (s_t[0], s_t[1], s_t[2], s_t[3], s_t[4]),
                                    (d_t[0], d_t[1], d_t[2], d_t[3], d_t[4]), WORLD)
            row = {"case": n, "src": _describe(s_t), "dst": _describe(d_t),
                   "tp_change": s_t[2] != d_t[2], "pp_change": s_t[3] != d_t[3],
                   "lower_bound_bytes": bound,
                   "planner_bytes": sum(sum(v) for v in acc.recv.values())}
            for m in ("planned", "naive"):
                # run i's time is the slowest rank's time in run i
                per_run = [max(r[m]["times_s"][i] for r in res) for i in range(args.repeats)]
                row[m] = {"bytes_moved": sum(r[m]["bytes_received"] for r in res),
                          "median_s": statistics.median(per_run), "runs_s": per_run,
                          "per_rank_runs_s": [r[m]["times_s"] for r in res],
                          "bit_exact": all(r[m]["bit_exact"] for r in res)}
            row["speedup"] = row["naive"]["median_s"] / max(row["planned"]["median_s"], 1e-9)
            row["at_lower_bound"] = row["planned"]["bytes_moved"] == bound == row["planner_bytes"]
            rows.append(row)
    changes = [r for r in rows if r["tp_change"] or r["pp_change"]]
    result: dict[str, Any] = {
        "study": "realloc",
        "config": {"model": spec.model_dump(), "head": args.head, "dtype": "float32",
                   "params": sum(t.numel for t in all_tensors(spec, args.head)),
                   "ranks": WORLD, "gpus_per_node": WORLD, "repeats": args.repeats,
                   "warmup": args.warmup, "cases": {n: CASES[n] for n in names},
                   "case_tuple": "(first_gpu, n_gpus, tp, pp, dp)"},
        "environment": {**_environment(args.threads), "rank_threads": rank_info},
        "started_unix_s": t_start, "wall_s": time.time() - t_start,
        "cases": rows,
        "summary": {
            "all_at_lower_bound": all(r["at_lower_bound"] for r in rows),
            "all_bit_exact": all(r[m]["bit_exact"] for r in rows for m in ("planned", "naive")),
            "min_speedup_on_tp_or_pp_change": min((r["speedup"] for r in changes), default=None),
            "tp_or_pp_changes_under_2x": [r["case"] for r in changes if r["speedup"] < 2.0],
        },
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text if args.json else _table(result))
    ok = result["summary"]["all_at_lower_bound"] and result["summary"]["all_bit_exact"]
    return 0 if ok else 1


def _table(res: dict) -> str:
    cfg = res["config"]
    lines = [f"realloc: {cfg['model']['name']} ({cfg['params'] / 1e6:.1f}M params, float32), "
             f"{cfg['ranks']} gloo ranks, median of {cfg['repeats']} runs",
             f"{'case':34} {'moved MB':>9} {'bound MB':>9} {'naive MB':>9} {'time ms':>8} "
             f"{'naive ms':>9} {'speedup':>8}  exact"]
    for r in res["cases"]:
        p, n = r["planned"], r["naive"]
        lines.append(f"{r['case']:34} {p['bytes_moved'] / 1e6:9.2f} "
                     f"{r['lower_bound_bytes'] / 1e6:9.2f} {n['bytes_moved'] / 1e6:9.2f} "
                     f"{p['median_s'] * 1e3:8.1f} {n['median_s'] * 1e3:9.1f} "
                     f"{r['speedup']:7.1f}x  {p['bit_exact'] and n['bit_exact']}")
    s = res["summary"]
    lines.append(f"all at lower bound: {s['all_at_lower_bound']}; all bit-exact: "
                 f"{s['all_bit_exact']}; min speed-up on TP/PP changes: "
                 f"{s['min_speedup_on_tp_or_pp_change']:.1f}x; TP/PP changes under 2x: "
                 f"{s['tp_or_pp_changes_under_2x'] or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m realign.bench.realloc ...`` (same as ``realign bench realloc ...``)."""
    p = argparse.ArgumentParser(prog="realign bench realloc", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
