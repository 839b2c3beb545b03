"""A few tiny GRPO steps with `realign run` on one GPU (bf16, the default training
forward), end to end: workers, records, generation waves, training, checkpoints and
the final model (whose config names the tensors' dtype)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from tests.run.conftest import REPO
from tests.run.run_records import metrics

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_tiny_grpo_runs_on_one_gpu(tmp_path):
    from realign.assets.tiny import make_tiny_assets

    make_tiny_assets(tmp_path / "tiny", seed=0, qwen2=False)
    (tmp_path / "tiny_reward.py").write_text((REPO / "experiments" / "tiny_reward.py").read_text())
    cfg = yaml.safe_load((REPO / "experiments" / "tiny-grpo-cpu.yaml").read_text())
    cfg.update(device="cuda", cluster={"nodes": 1, "gpus_per_node": 1, "device": "h100-80g"},
               run={"steps": 3, "checkpoint_interval": 2, "seed": 0})
    exp = tmp_path / "gpu.yaml"
    exp.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "realign.cli.main", "run", str(exp), "--run-dir",
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(torch.isfinite(torch.tensor(row["actor.loss"])) for row in rows)
    final = json.loads((tmp_path / "run" / "final" / "actor" / "config.json").read_text())
    assert final["torch_dtype"] == "bfloat16"
