"""The own engine's decode step on CPU, eager against torch.compile'd (what
``rollout.capture: on`` runs on CPU), on the bench model (8 layers, width 512, 8 heads of
64, 4 KV heads, FFN 1536, vocabulary 73), fp32: B rows (env B, default 64), each at
position 8 of a 128-position cache, 40 keys attended; the compilation's seconds, then 3
rounds of 30 steps each side, interleaved (median and min per round). Env T: threads
(default 1). Run: ``.venv/bin/python -m realign.bench.studies.generate_decode_capture_cpu``.
Results: benchmarks/generate/README.md."""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec
from realign.runtime.device import init_device
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.groups import build_replica_groups
from realign.runtime.model import build_model

SPEC = ModelSpec(name="bench", n_layers=8, hidden=512, n_heads=8, n_kv_heads=4,
                 ffn_hidden=1536, vocab_size=73, max_seq_len=256)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("T", "1")))
    rows = int(os.environ.get("B", "64"))
    dev = init_device("cpu", dtype="fp32")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    g = build_replica_groups(SPEC, DeviceMesh(first_gpu=0, n_gpus=1), Layout(tp=1, pp=1, dp=1))
    shard = build_model(SPEC, "lm", g, dev, seed=1)
    with torch.inference_mode():
        with torch.inference_mode(False):
            dec = StageDecoder(shard, 128, cache_rows=rows)
        dec.prefill(torch.randint(3, 70, (rows, 8)), torch.full((rows,), 8))
        x, pos = torch.randint(3, 70, (rows, 1)), torch.full((rows,), 8)
        t0 = time.perf_counter()
        comp = torch.compile(dec.eager_step, dynamic=False)
        diff = (comp(x, pos, 40) - dec.eager_step(x, pos, 40)).abs().max().item()
        print(f"rows {rows}: compile {time.perf_counter() - t0:.1f} s, max logit diff {diff:.1e}")
        for rnd in range(3):
            for name, f in (("eager", lambda: dec.eager_step(x, pos, 40)),
                            ("compiled", lambda: comp(x, pos, 40))):
                ts = []
                for _ in range(30):
                    t = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t)
                print(f"round {rnd} {name:>8}: median {1e3 * statistics.median(ts):.3f} ms, "
                      f"min {1e3 * min(ts):.3f} ms per step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
