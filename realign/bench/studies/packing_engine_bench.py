"""Packed vs padded train steps and scoring calls of the tiny actor in one process, on
batches whose lengths are drawn like tiny-reason's rollouts (prompts of 8, responses a
censored geometric of mean MEAN, cap 240), interleaved: each round times one padded and
one packed call of each kind on the same batch and weights. Prints and writes
medians and ranges. Usage, from the repository root after `realign make-tiny
experiments/tiny`:
    python -m realign.bench.studies.packing_engine_bench OUT.json [ROUNDS] [ROWS] [MICRO] [MEAN]"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ACTOR = "experiments/tiny/actor"


def bench(ctx, rounds: int, rows: int, micro: int, mean: float) -> dict:
    import torch

    from planner.graph.lengths import GenLengths
    from planner.specs.layout import Layout
    from planner.specs.mesh import DeviceMesh
    from realign.data.packing import call_padding
    from realign.runtime.device import init_device
    from realign.runtime.engines.inference import InferenceEngine
    from realign.runtime.engines.train import TrainEngine
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import HFReader, load_hf_weights, spec_from_hf
    from realign.runtime.model import build_model
    from realign.runtime.settings import TrainConfig

    torch.manual_seed(0)
    spec = spec_from_hf(ACTOR)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1), Layout())
    shard = build_model(spec, "lm", groups, init_device("cpu"), init_weights=False)
    load_hf_weights(shard, ACTOR, HFReader(ACTOR))
    pmf = GenLengths(max_len=240, mean=mean).pmf()
    g = torch.Generator().manual_seed(1)
    resp = torch.multinomial(torch.tensor(pmf), rows, replacement=True, generator=g) + 1
    lengths = resp + 8
    width = int(lengths.max())
    batch = {"tokens": torch.randint(0, spec.vocab_size, (rows, width), generator=g),
             "lengths": lengths}

    def loss(out, mb):
        valid = (torch.arange(1, out.shape[1] + 1) < mb["lengths"].unsqueeze(1)).float()
        return -(out * valid).sum() / valid.sum(), {}

    engines = {p: (TrainEngine(shard, TrainConfig(lr=1e-12, packing=p), micro_batches=micro),
                   InferenceEngine(shard, micro_batches=micro, packing=p))
               for p in (False, True)}
    times: dict[str, list[float]] = {f"{k}_{p}": [] for k in ("train", "score")
                                     for p in ("padded", "packed")}
    for _ in range(rounds + 1):                       # the first round warms up
        for p, name in ((False, "padded"), (True, "packed")):
            train, score = engines[p]
            t = time.perf_counter()
            train.train_step(batch, loss)
            times[f"train_{name}"].append(time.perf_counter() - t)
            t = time.perf_counter()
            score.inference(batch)
            times[f"score_{name}"].append(time.perf_counter() - t)
    out = {k: v[1:] for k, v in times.items()}
    return {"rounds": out, "lengths": lengths.tolist(), "width": width,
            "padded_tokens": {name: call_padding(lengths, width, 1, micro, "train", p)
                              for p, name in ((False, "padded"), (True, "packed"))},
            "threads": torch.get_num_threads()}


def main() -> None:
    from realign.runtime.local_world import LocalWorld

    out = Path(sys.argv[1])
    rounds, rows, micro = (int(x) for x in (sys.argv[2:5] + ["7", "16", "2"][len(sys.argv[2:5]):]))
    mean = float(sys.argv[5]) if len(sys.argv) > 5 else 103.0
    with LocalWorld(1, timeout_s=900) as w:
        res = w.run("realign.bench.studies.packing_engine_bench:bench", rounds, rows, micro, mean)[0]
    res["settings"] = {"rounds": rounds, "rows": rows, "micro_batches": micro, "mean": mean}
    for k, v in res["rounds"].items():
        print(f"{k:14s} median {statistics.median(v):.4f} s  range {min(v):.4f} .. {max(v):.4f}")
    print("padded tokens per train step:", res["padded_tokens"], "width", res["width"])
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
