"""Shared fixtures of the `realign run` tests: tiny assets made once per session."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    from realign.assets.tiny import make_tiny_assets
    root = tmp_path_factory.mktemp("assets")
    make_tiny_assets(root / "tiny", seed=0, qwen2=False)
    shutil.copy(REPO / "experiments" / "tiny_reward.py", root / "tiny_reward.py")
    return root


def experiment(assets: Path, name: str, tmp: Path, **changes) -> Path:
    """A copy of experiments/<name>.yaml next to the tiny assets, with changes
    (``section.key=value`` written as ``section__key=value``)."""
    cfg = yaml.safe_load((REPO / "experiments" / f"{name}.yaml").read_text())
    for dotted, value in changes.items():
        keys = dotted.split("__")
        cur = cfg
        for k in keys[:-1]:
            cur = cur.setdefault(k, {})
        if value is None:
            cur.pop(keys[-1], None)
        else:
            cur[keys[-1]] = value
    path = assets / f"{tmp.name}-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def wait_for_rows(run_dir: Path, n: int, timeout_s: float = 240) -> None:
    """Wait until a run has written ``n`` whole rows of metrics (or the timeout passed;
    the caller's assertions then say what is missing)."""
    m = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if m.exists() and m.read_text().count("\n") >= n:
            return
        time.sleep(0.01)      # a tiny step takes ~10 ms: kill close to the n-th row


def kill_after(exp: Path, run_dir: Path, n_rows: int) -> None:
    """Start ``realign run`` and SIGKILL its process group (controller and workers) once
    ``n_rows`` steps are logged. The kill lands some steps after that row, and a run
    keeps only its newest checkpoints (``checkpoint.KEEP_LAST``): assert on the newest
    committed one (``checkpoint.committed``), not on one step's. The run runs at a lower
    priority (nice 10), so that on a busy machine this process, which watches the
    metrics, is not kept waiting for a core while the run races past its end."""
    p = subprocess.Popen([sys.executable, "-m", "realign.cli.main", "run", str(exp),
                          "--run-dir", str(run_dir)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, preexec_fn=lambda: os.nice(10))
    wait_for_rows(run_dir, n_rows)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
