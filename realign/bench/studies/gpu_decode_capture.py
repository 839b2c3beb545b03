"""realign's own decode step, eager against captured (CUDA graphs), on an 8B-shaped model
(LLaMA-3 8B: 32 layers, width 4096, 32 heads, 8 KV heads, FFN 14336, vocabulary 128256)
with random bf16 weights, beside the planner's price of the same step on the H100
preset. Run by ``decode_capture.sh`` on a GPU machine; ``--tiny`` runs a 2-layer model
of width 64 on the CPU (captured there means torch.compile) to check the script.

What one step is: :meth:`StageDecoder.step
<realign.runtime.engines.decoder.StageDecoder.step>` of every row of a KV cache of
``--context`` positions already filled (random keys and values: a step's cost does not
depend on them), each row at position ``--context - --steps``, plus the greedy choice
of the next tokens; the eager and the captured runs start from the same cache and
token and write the same positions, so their greedy tokens can be compared. Timed with
CUDA events around each step after warm-up steps (the captures happen in the warm-up);
median, and min-max, of ``--steps`` steps.

Writes ``decode_capture.json`` under ``$OUT`` (or ``--out``) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.engine_terms import Work
from planner.cost.passes import decode_iteration
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec, resolve_model
from realign.bench.machine import describe
from realign.runtime.device import init_device
from realign.runtime.engines.captured_step import capture_mode, capture_steps
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.groups import build_replica_groups
from realign.runtime.model import ModelShard, build_model

TINY = ModelSpec(name="tiny-decode", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2,
                 ffn_hidden=128, vocab_size=256, max_seq_len=512)


def parse() -> argparse.Namespace:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--tiny", action="store_true", help="2 layers of width 64 on the CPU")
    a.add_argument("--batches", default="64,256", help="rows per step, comma-separated")
    a.add_argument("--layers", type=int, default=32, help="layers of the 8B shape")
    a.add_argument("--context", type=int, default=1024, help="KV-cache positions per row")
    a.add_argument("--steps", type=int, default=40, help="timed steps per run")
    a.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    a.add_argument("--check", type=int, default=8, help="greedy steps compared")
    a.add_argument("--preset", default="h100-80g", help="the planner's device preset")
    a.add_argument("--fp32", action="store_true",
                   help="fp32 weights and cache (greedy parity without bf16 near-ties)")
    a.add_argument("--out", default=os.environ.get("OUT", "out"))
    return a.parse_args()


def model(args: argparse.Namespace) -> tuple[ModelSpec, ModelShard]:
    """The shard of a one-rank world, random weights (normal, std 0.02; norms 1)."""
    kind: Literal["cpu", "cuda"] = "cpu" if args.tiny else "cuda"
    dev = init_device(kind, dtype="fp32" if args.tiny or args.fp32 else "bf16")
    dist.init_process_group("gloo" if args.tiny else "cpu:gloo,cuda:nccl",
                            init_method="tcp://127.0.0.1:29571", rank=0, world_size=1)
    base = TINY if args.tiny else resolve_model("llama3-8b")
    spec = base.model_copy(update={"n_layers": base.n_layers if args.tiny else args.layers,
                                   "max_seq_len": max(base.max_seq_len, args.context)})
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1),
                                  Layout(tp=1, pp=1, dp=1))
    shard = build_model(spec, "lm", groups, dev, seed=1, init_weights=False)
    gen = torch.Generator(device=dev.device).manual_seed(1)
    with torch.no_grad():
        for name, p in shard.module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return spec, shard


def decoder(shard, rows: int, context: int) -> StageDecoder:
    with torch.inference_mode(False):
        dec = StageDecoder(shard, context, cache_rows=rows)
    gen = torch.Generator(device=shard.device.device).manual_seed(2)
    for t in dec.k + dec.v:
        t.normal_(0.0, 1.0, generator=gen)
    return dec


class Run:
    """Steps of one decoder from one start, eager or replayed."""

    def __init__(self, dec: StageDecoder, start: int, x0: torch.Tensor, vocab: int):
        self.dec, self.start, self.x0, self.vocab = dec, start, x0, vocab

    def greedy(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy tokens [n, rows], their log-probs, and the first step's logits."""
        x, pos = self.x0.clone(), torch.full_like(self.x0[:, 0], self.start)
        toks, lps, first = [], [], None
        for s in range(n):
            logits = self.dec.step(x, pos + s, self.start + s + 1).float()[:, :self.vocab]
            first = logits.clone() if first is None else first
            lp = logits.log_softmax(-1)
            x = lp.argmax(-1, keepdim=True)
            toks.append(x[:, 0])
            lps.append(lp.gather(1, x)[:, 0])
        assert first is not None, "greedy() takes at least one step"
        return torch.stack(toks), torch.stack(lps), first


    def timed(self, warmup: int, n: int, cuda: bool) -> dict:
        """Seconds per step (device time between events on CUDA, wall time on CPU) and
        the host's seconds to issue one step."""
        x, pos = self.x0.clone(), torch.full_like(self.x0[:, 0], self.start)
        dev_s, host_s = [], []
        for s in range(warmup + n):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
            t0 = time.perf_counter()
            logits = self.dec.step(x, pos + s, self.start + s + 1)
            x = logits[:, :self.vocab].argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            if cuda:
                b.record()
                torch.cuda.synchronize()
                dt = a.elapsed_time(b) / 1e3
            else:
                dt = t1 - t0
            if s >= warmup:
                dev_s.append(dt)
                host_s.append(t1 - t0)
        return {"step_s": statistics.median(dev_s), "step_min_s": min(dev_s),
                "step_max_s": max(dev_s), "host_issue_s": statistics.median(host_s),
                "steps": dev_s}


def agreement(tok_e, tok_c, lp_e, lp_c, first_e, first_c) -> dict:
    """How far the captured steps agree with the eager ones: the first step's logits
    (relative L2 error, and the share of rows whose top-2 margin is below that step's
    largest logit difference, where bf16 rounding can flip a greedy choice), and per row
    the steps equal before the first different token, with the log-probs up to there."""
    diff = (first_e - first_c).abs()
    top2 = first_e.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    same = (tok_e == tok_c).int().cumprod(0)          # 1 until a row's first difference
    upto = same.bool()
    return {"first_logits_rel_err": float(diff.norm() / first_e.norm()),
            "first_logits_max_abs_diff": float(diff.max()),
            "rows_near_tie": int((margin < diff.max()).sum()),
            "steps_equal_before_divergence_mean": float(same.sum(0).float().mean()),
            "rows_never_diverging": int(same[-1].sum()),
            "logprob_max_diff_before_divergence":
                float((lp_e - lp_c).abs()[upto].max()) if upto.any() else 0.0}


def planned(spec: ModelSpec, preset: str, rows: int, ctx: float, capture: str) -> float:
    """The planner's price of one decode step of ``rows`` rows over ``ctx`` keys on one
    device of ``preset`` (TP = PP = 1): the pass and its fixed costs."""
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device(preset))
    cm = CostModel(cluster, CostModelConfig(decode_capture=capture))
    stages = cm.stage_works(spec, "lm", "decode", rows, ctx, rows, Layout(tp=1, pp=1, dp=1),
                            1, Work())
    costs = cm.rates.engine("decode")
    return decode_iteration(stages, 1, costs).total(costs)


def main() -> int:
    args = parse()
    torch.manual_seed(0)
    if args.tiny:
        torch.set_num_threads(1)
        args.batches, args.context, args.steps, args.warmup = "4,8", 96, 6, 2
    spec, shard = model(args)
    cuda = shard.device.kind == "cuda"
    mode = capture_mode("on", shard.device.kind)
    rows_out: list[dict] = []
    for rows in [int(b) for b in args.batches.split(",")]:
        start = args.context - args.warmup - max(args.steps, args.check) - 1
        x0 = torch.randint(0, spec.vocab_size, (rows, 1), device=shard.device.device)
        with torch.inference_mode():
            dec = decoder(shard, rows, args.context)
            eager = Run(dec, start, x0, spec.vocab_size)
            tok_e, lp_e, first_e = eager.greedy(args.check)
            t_eager = eager.timed(args.warmup, args.steps, cuda)
            t0 = time.perf_counter()
            capture_steps(dec, mode)
            captured = Run(dec, start, x0, spec.vocab_size)
            try:
                tok_c, lp_c, first_c = captured.greedy(args.check)
                first_s = time.perf_counter() - t0
                t_capt = captured.timed(args.warmup, args.steps, cuda)
            except Exception as e:      # the eager numbers still come back
                print(f"rows {rows}: the captured step failed: {e!r}", flush=True)
                rows_out.append({"rows": rows, "eager": t_eager, "captured_error": repr(e)})
                continue
        ctx = start + args.warmup + args.steps / 2
        row = {"rows": rows, "context_start": start, "eager": t_eager, "captured": t_capt,
               "captures": len(dec.replay.captures) if dec.replay else 0,
               "first_captured_steps_s": first_s,
               "greedy_equal": int((tok_e == tok_c).sum()), "greedy_total": tok_e.numel(),
               "greedy_rows_equal": int((tok_e == tok_c).all(0).sum()),
               "logprob_max_diff": float((lp_e - lp_c).abs().max()),
               **agreement(tok_e, tok_c, lp_e, lp_c, first_e, first_c),
               "planned_eager_s": planned(spec, args.preset, rows, ctx, "off"),
               "planned_captured_s": planned(spec, args.preset, rows, ctx, "on")}
        rows_out.append(row)
        print(f"rows {rows}: eager {t_eager['step_s'] * 1e3:.3f} ms, captured "
              f"{t_capt['step_s'] * 1e3:.3f} ms", flush=True)
        del dec
        if cuda:
            torch.cuda.empty_cache()
    record = {
        "what": "realign's decode step, eager vs captured; "
                "python -m realign.bench.studies.gpu_decode_capture",
        "args": vars(args), "spec": spec.model_dump(), "capture_mode": mode,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "machine": describe(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": rows_out}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_capture.json").write_text(json.dumps(record, indent=1))
    L = spec.n_layers
    print(f"\n{record['device']}, torch {torch.__version__}, {L} layers, width {spec.hidden}, "
          f"{'fp32' if args.tiny or args.fp32 else 'bf16'}, capture {mode}, planner preset {args.preset}")
    print(f"{'rows':>5} {'eager ms':>9} {'capt ms':>8} {'x':>5} {'eager/L':>8} {'capt/L':>7} "
          f"{'host e/c ms':>12} {'plan e/c ms':>13} {'greedy eq':>10} {'lp diff':>8}")
    for r in rows_out:
        if "captured_error" in r:
            print(f"{r['rows']:>5} {r['eager']['step_s'] * 1e3:>9.3f}  captured failed")
            continue
        eager_ms, capt_ms = r["eager"]["step_s"] * 1e3, r["captured"]["step_s"] * 1e3
        print(f"{r['rows']:>5} {eager_ms:>9.3f} {capt_ms:>8.3f} {eager_ms / capt_ms:>5.2f} "
              f"{eager_ms / L:>8.3f} {capt_ms / L:>7.3f} "
              f"{r['eager']['host_issue_s'] * 1e3:>5.2f}/{r['captured']['host_issue_s'] * 1e3:<6.2f} "
              f"{r['planned_eager_s'] * 1e3:>6.2f}/{r['planned_captured_s'] * 1e3:<6.2f} "
              f"{r['greedy_equal']:>4}/{r['greedy_total']:<5} {r['logprob_max_diff']:>8.1e}")
    for r in rows_out:
        if "captured_error" not in r:
            print(f"rows {r['rows']}: first step's logits rel. error {r['first_logits_rel_err']:.1e} "
                  f"(max abs {r['first_logits_max_abs_diff']:.2e}; {r['rows_near_tie']} rows with a "
                  f"top-2 margin below it); steps equal before a row's first different token "
                  f"{r['steps_equal_before_divergence_mean']:.1f} of {args.check} on average, "
                  f"{r['rows_never_diverging']} rows never; log-prob diff before divergence "
                  f"{r['logprob_max_diff_before_divergence']:.1e}")
    print(f"wrote {out / 'decode_capture.json'}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
