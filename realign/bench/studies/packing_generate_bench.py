"""Generation that refills its slots vs static waves, realign's own engine, the tiny
actor in one process: ROWS rows, SAMPLES consecutive samples of each of ROWS / SAMPLES
prompts of tiny-reason's training data (as GRPO lays out a rollout), sampled at
temperature 1 up to 240 tokens with the end token as stop, in WAVES waves (the plan's
micro-batches: the KV cache holds ROWS / WAVES rows). Each round draws with its own seed
and times one call of each mode on it (the same sequences: tested); then the planner's
price of both calls (the cpu device preset, no profile), given the lengths the rounds
generated. Prints and writes medians and ranges. Usage, from the repository root after
`realign make-tiny experiments/tiny`:
    python -m realign.bench.studies.packing_generate_bench OUT.json [ROUNDS] [ROWS] [WAVES] [SAMPLES]"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ACTOR = "experiments/tiny/actor"
DATA = "experiments/tiny/math_train.jsonl"
CAP = 240


def bench(ctx, rounds: int, rows: int, waves: int, samples: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.device import init_device
    from realign.runtime.engines.generate import GenerateEngine
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import HFReader, load_hf_weights, spec_from_hf
    from realign.runtime.model import build_model
    from realign.runtime.sampling import SamplingParams

    spec = spec_from_hf(ACTOR)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1), Layout())
    shard = build_model(spec, "lm", groups, init_device("cpu"), init_weights=False)
    load_hf_weights(shard, ACTOR, HFReader(ACTOR))
    tok = AutoTokenizer.from_pretrained(ACTOR)
    texts = [json.loads(line)["prompt"] for line in Path(DATA).read_text().splitlines()]
    prompts = [tok(t)["input_ids"][:8] for t in texts[:rows // samples] for _ in range(samples)]
    engine = GenerateEngine(shard, pad_id=0)
    out: dict = {"time_waves": [], "time_refill": [], "steps_waves": [], "steps_refill": [],
                 "lengths": []}
    for r in range(rounds + 1):                     # the first round warms up
        p = SamplingParams(max_new_tokens=CAP, seed=1000 + r, stop_token_ids=(tok.eos_token_id,))
        got = {}
        for refill in (False, True):
            t = time.perf_counter()
            g = engine.generate(prompts, p, waves=waves, refill=refill)
            dt = time.perf_counter() - t
            got[refill] = g
            if r:
                name = "refill" if refill else "waves"
                out[f"time_{name}"].append(dt)
                out[f"steps_{name}"].append(g.decode_steps)
        assert torch.equal(got[False].tokens, got[True].tokens)
        if r:
            out["lengths"].append(got[True].lengths.tolist())
    out["threads"] = torch.get_num_threads()
    return out


def estimate(rows: int, waves: int, lengths: list[list[int]]) -> dict:
    """The planner's price of both calls, given the histogram of the generated lengths."""
    from collections import Counter

    from planner.cost.cost_model import CostModel
    from planner.graph.dataflow import MFC
    from planner.graph.lengths import GenLengths, expected_call_tokens
    from planner.graph.refill import refill_shape
    from planner.specs.cluster import ClusterSpec, resolve_device
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.hf_checkpoint import spec_from_hf

    hist = Counter(n for rnd in lengths for n in rnd)
    dist = GenLengths(max_len=CAP, histogram=tuple(sorted(hist.items())))
    spec = spec_from_hf(ACTOR)
    cost = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("cpu")))
    res = {}
    for refill in (False, True):
        m = MFC(name="actor.generate", role="actor", kind="generate", n_seqs=rows,
                prompt_len=8, gen_len=CAP, input_keys=("prompts",), output_keys=("seqs",),
                lengths=dist, refill=refill)
        c = cost.mfc_cost(m, spec, "lm", DeviceMesh(first_gpu=0, n_gpus=1), Layout(), waves)
        res["refill" if refill else "waves"] = c.time_s
    res["steps_refill"] = refill_shape(m, -(-rows // waves), rows, 1)[0]
    res["steps_waves"] = waves * (expected_call_tokens(m, rows / waves, waves, 1) - 1)
    return res


def main() -> None:
    from realign.bench.machine import describe
    from realign.bench.plans import spread
    from realign.runtime.local_world import LocalWorld

    out = Path(sys.argv[1])
    rounds, rows, waves, samples = (int(x) for x in (
        sys.argv[2:6] + ["7", "32", "4", "4"][len(sys.argv[2:6]):]))
    with LocalWorld(1, timeout_s=1800) as w:
        res = w.run("realign.bench.studies.packing_generate_bench:bench", rounds, rows, waves, samples)[0]
    est = estimate(rows, waves, res["lengths"])
    speedups = [a / b for a, b in zip(res["time_waves"], res["time_refill"])]
    summary = {
        "time_waves": spread(res["time_waves"]), "time_refill": spread(res["time_refill"]),
        "speedup_measured": spread(speedups),
        "steps_waves": spread(res["steps_waves"]), "steps_refill": spread(res["steps_refill"]),
        "estimate": est, "speedup_planned": est["waves"] / est["refill"],
        "mean_length": statistics.mean(n for r in res["lengths"] for n in r),
        "at_cap": sum(n == CAP for r in res["lengths"] for n in r) / sum(len(r) for r in res["lengths"]),
    }
    record = {"settings": {"rounds": rounds, "rows": rows, "waves": waves, "samples": samples,
                           "cap": CAP},
              "machine": describe(), "date": time.strftime("%Y-%m-%d"), "summary": summary,
              "rounds": res}
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
