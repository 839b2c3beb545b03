"""What a finished (or cut) ``realign run`` left in its run folder, read back for tests:
its ``metrics.jsonl`` rows and a role's final weights. Shared by the cpu_dist, slurm and
ray tiers (``from tests.run.run_records import metrics, final_weights``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:        # torch only where weights are read: pure-tier files use metrics()
    import torch


def metrics(run_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl``: one dict per logged row, in the order written."""
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path, role: str = "actor") -> dict[str, torch.Tensor]:
    """Every tensor of ``final/<role>/*.safetensors`` by name (the shards merged, read in
    file-name order)."""
    from safetensors.torch import load_file
    out: dict[str, torch.Tensor] = {}
    for f in sorted((run_dir / "final" / role).glob("*.safetensors")):
        out.update(load_file(f))
    return out
