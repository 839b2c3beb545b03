"""The planner's estimate of one actor train call and one scoring call of the tiny
actor, padded and packed, on the device preset `cpu` (no profile): the numbers
packing_engine_bench's measurements are compared with. Usage, from the repository root:
    python -m realign.bench.studies.packing_estimate [ROWS] [MICRO] [MEAN]"""
from __future__ import annotations

import sys

from planner.cost.cost_model import CostModel
from planner.graph.dataflow import MFC
from planner.graph.lengths import GenLengths
from planner.graph.padding import padded_len
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from realign.runtime.hf_checkpoint import spec_from_hf


def main(rows: int, micro: int, mean: float) -> None:
    spec = spec_from_hf("experiments/tiny/actor")
    cm = CostModel(ClusterSpec(n_nodes=1, gpus_per_node=1, device=resolve_device("cpu")))
    one = DeviceMesh(first_gpu=0, n_gpus=1)
    for kind in ("train", "inference"):
        t = {}
        for packed in (False, True):
            m = MFC(name=f"actor.{kind}", role="actor", kind=kind, n_seqs=rows, prompt_len=8,
                    gen_len=240, input_keys=("seqs",), output_keys=("x",),
                    lengths=GenLengths(max_len=240, mean=mean), packed=packed)
            t[packed] = cm.mfc_cost(m, spec, "lm", one, Layout(), micro).time_s
        print(f"{kind}: padded {t[False]:.4f} s, packed {t[True]:.4f} s, speed-up "
              f"{t[False] / t[True]:.3f}x (padded rows priced at {padded_len(m):.1f} tokens)")


if __name__ == "__main__":
    args = sys.argv[1:] + ["16", "2", "103"][len(sys.argv[1:]):]
    main(int(args[0]), int(args[1]), float(args[2]))
