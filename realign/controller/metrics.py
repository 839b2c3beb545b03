"""Where a run's numbers go: a JSONL file (one line per step), TensorBoard, and a
progress line on the terminal."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _step_of(line: str) -> int | None:
    """The step of a metrics line, or None for a line cut off (a killed run) or damaged."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None


class MetricsLog:
    """``RUN/metrics.jsonl`` (one JSON object per step) and TensorBoard events under
    ``RUN/tensorboard``. On resume, lines past the checkpoint (and lines that are not
    whole rows: a kill can cut the last one off) are dropped first."""

    def __init__(self, run_dir: Path, resume_step: int):
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            lines = self.path.read_text(errors="replace").splitlines()
            kept = [ln for ln in lines if (s := _step_of(ln)) is not None and s < resume_step]
            part = self.path.with_suffix(".part")
            part.write_text("".join(ln + "\n" for ln in kept))
            os.replace(part, self.path)
        from tensorboardX import FileWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self.tb = FileWriter(str(run_dir / "tensorboard"))
        # TensorBoard hides events at or past a START marker's step: the resumed
        # steps replace those a killed run had written
        self.tb.add_event(Event(step=resume_step, file_version="brain.Event:2"))
        self.tb.add_event(Event(step=resume_step, session_log=SessionLog(status=SessionLog.START)))
        self.f = open(self.path, "a")

    def write(self, row: dict) -> None:
        """One JSONL line and one TensorBoard event holding every scalar of the step (one
        event per scalar, as ``add_scalar`` writes, costs ~0.1 ms each: the controller
        shares the CPU with the workers)."""
        from tensorboardX.proto.summary_pb2 import Summary

        self.f.write(json.dumps(row) + "\n")
        self.f.flush()
        values = [Summary.Value(tag=k.replace(".", "/"), simple_value=float(v))
                  for k, v in row.items() if k != "step" and isinstance(v, (int, float))]
        self.tb.add_summary(Summary(value=values), row["step"])
        self.tb.flush()

    def close(self) -> None:
        self.f.close()
        self.tb.close()


class Progress:
    """A one-line progress bar: step, reward, KL, loss, tokens/s and ETA."""

    def __init__(self, total: int, start: int, stream=None):
        self.total, self.start = total, start
        self.t0 = time.monotonic()
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()

    def update(self, step: int, row: dict) -> None:
        done = step + 1 - self.start
        elapsed = time.monotonic() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step - 1)
        width = 20
        fill = int(width * (step + 1) / self.total)
        parts = [f"step {step + 1}/{self.total} [{'#' * fill}{'.' * (width - fill)}]"]
        for name, key in (("reward", "reward_mean"), ("kl", "kl"), ("loss", "loss"),
                          ("tok/s", "tokens_per_s")):
            if key in row and row[key] is not None:
                parts.append(f"{name} {row[key]:.4g}")
        parts.append(f"ETA {int(eta) // 60}m{int(eta) % 60:02d}s")
        line = "  ".join(parts)
        if self.tty:
            self.stream.write("\r" + line.ljust(100))
            if step + 1 == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
