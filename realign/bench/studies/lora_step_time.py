"""Train-step time of PEFT's LoRA (``lora.shared_a: false``, the default) against one A
per fused layer (``shared_a: true``) on a tiny model in one process, interleaved: each
round times one step of each variant on the same batch (their own replicas, the same
base). Writes every round's times, the load average before and after each round, and
the environment. Usage, from the repository root:
    python -m realign.bench.studies.lora_step_time OUT.json [ROUNDS] [MODEL] [RANK]
MODEL: actor (width 64, 2 layers) or small_actor (width 256, 4 layers), made here with
realign's tiny assets."""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def bench(ctx, path: str, rounds: int, rank: int, rows: int, width: int) -> dict:
    import torch

    from planner.specs.layout import Layout
    from planner.specs.lora import LoraSpec
    from planner.specs.mesh import DeviceMesh
    from realign.runtime.device import init_device
    from realign.runtime.engines.train import TrainEngine
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.hf_checkpoint import HFReader, load_hf_weights, spec_from_hf
    from realign.runtime.lora import attach_lora
    from realign.runtime.model import build_model
    from realign.runtime.settings import TrainConfig

    spec = spec_from_hf(path)
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=0, n_gpus=1), Layout())
    g = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, spec.vocab_size, (rows, width), generator=g),
             "lengths": torch.full((rows,), width)}

    def loss(out, mb):
        return -out.mean(), {}

    engines, trained = {}, {}
    for shared in (False, True):
        shard = build_model(spec, "lm", groups, init_device("cpu"), init_weights=False)
        load_hf_weights(shard, path, HFReader(path))
        lora = LoraSpec(rank=rank, alpha=2 * rank, shared_a=shared)
        attach_lora(shard, lora, seed=0)
        trained[str(shared)] = lora.total_params(spec)
        engines[shared] = TrainEngine(shard, TrainConfig(lr=1e-4), micro_batches=1)
    times: dict[str, list[float]] = {"peft": [], "shared_a": []}
    load: list[list[float]] = []
    for i in range(rounds + 1):                       # the first round warms up
        before = os.getloadavg()[0]
        order = (False, True) if i % 2 == 0 else (True, False)
        for shared in order:
            t = time.perf_counter()
            engines[shared].train_step(batch, loss)
            times["shared_a" if shared else "peft"].append(time.perf_counter() - t)
        load.append([before, os.getloadavg()[0]])
    return {"rounds": {k: v[1:] for k, v in times.items()}, "load_1min": load[1:],
            "trained_params": trained, "threads": torch.get_num_threads()}


def main() -> None:
    from realign.assets.tiny import make_tiny_assets
    from realign.bench.machine import describe
    from realign.runtime.local_world import LocalWorld

    out = Path(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    model = sys.argv[3] if len(sys.argv) > 3 else "small_actor"
    rank = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    rows, width = 16, 64
    assets = make_tiny_assets(Path(tempfile.mkdtemp(prefix="lora-bench-")), seed=0,
                              qwen2=False)
    with LocalWorld(1, timeout_s=1800) as w:
        res = w.run("realign.bench.studies.lora_step_time:bench", str(assets[model]), rounds,
                    rank, rows, width)[0]
    res["settings"] = {"rounds": rounds, "model": model, "rank": rank, "alpha": 2 * rank,
                       "target_modules": "all-linear", "rows": rows, "width": width,
                       "micro_batches": 1}
    res["environment"] = describe()
    for k, v in res["rounds"].items():
        print(f"{k:9s} median {statistics.median(v):.4f} s  range {min(v):.4f} .. {max(v):.4f}")
    ratio = [a / b for a, b in zip(res["rounds"]["peft"], res["rounds"]["shared_a"])]
    print(f"peft / shared_a per round: median {statistics.median(ratio):.3f}, "
          f"range {min(ratio):.3f} .. {max(ratio):.3f}")
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
