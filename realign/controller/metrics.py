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


def _keep_before(path: Path, step: int) -> None:
    """Drop a JSONL file's lines of steps at or past ``step`` (and broken lines)."""
    if path.exists():
        lines = path.read_text(errors="replace").splitlines()
        kept = [ln for ln in lines if (s := _step_of(ln)) is not None and s < step]
        part = path.with_suffix(".part")
        part.write_text("".join(ln + "\n" for ln in kept))
        os.replace(part, path)


def restore(path: Path, steps: int, saved: dict[int, tuple[str, str]]
            ) -> tuple[list[tuple[int, str]], list[int]]:
    """Make ``path`` (metrics.jsonl) hold one whole line for each of the first ``steps``
    steps, in step order: its own line where it has one (the first, if a step appears
    twice), else the checkpoints' copy (``saved``: step -> (line, checkpoint)); lines of
    later steps and broken lines are dropped. Returns ((step, checkpoint) restored,
    steps that neither holds)."""
    mine: dict[int, str] = {}
    if path.exists():
        for ln in path.read_text(errors="replace").splitlines():
            s = _step_of(ln)
            if s is not None and s < steps:
                mine.setdefault(s, ln)
    restored, lost, lines = [], [], []
    for s in range(steps):
        if s in mine:
            lines.append(mine[s])
        elif s in saved:
            lines.append(saved[s][0])
            restored.append((s, saved[s][1]))
        else:
            lost.append(s)
    if path.exists() or lines:
        part = path.with_suffix(".part")
        part.write_text("".join(ln + "\n" for ln in lines))
        os.replace(part, path)
    return restored, lost


class MetricsLog:
    """``RUN/metrics.jsonl`` (one JSON object per step), ``RUN/timeline.jsonl`` (each
    step's ops with their wall-clock start and end: ``{"step", "events": [[label, kind,
    start, end, gpus], ...]}``) and TensorBoard events under ``RUN/tensorboard``. On
    resume, lines past the checkpoint (and lines that are not whole rows: a kill can
    cut the last one off) are dropped first."""

    def __init__(self, run_dir: Path, resume_step: int):
        self.path = run_dir / "metrics.jsonl"
        self.timeline_path = run_dir / "timeline.jsonl"
        for p in (self.path, self.timeline_path):
            _keep_before(p, resume_step)
        from tensorboardX import FileWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self.tb = FileWriter(str(run_dir / "tensorboard"))
        # TensorBoard hides events at or past a START marker's step: the resumed
        # steps replace those a killed run had written
        self.tb.add_event(Event(step=resume_step, file_version="brain.Event:2"))
        self.tb.add_event(Event(step=resume_step, session_log=SessionLog(status=SessionLog.START)))
        self.f = open(self.path, "a")
        self.timeline = open(self.timeline_path, "a")

    def write(self, row: dict, events: list | None = None) -> str:
        """One JSONL line and one TensorBoard event holding every scalar of the step (one
        event per scalar, as ``add_scalar`` writes, costs ~0.1 ms each: the controller
        shares the CPU with the workers). Returns the line (without its newline)."""
        from tensorboardX.proto.summary_pb2 import Summary

        line = json.dumps(row)
        self.f.write(line + "\n")
        self.f.flush()
        if events:
            self.timeline.write(json.dumps({"step": row["step"], "events": events}) + "\n")
            self.timeline.flush()
        values = [Summary.Value(tag=k.replace(".", "/"), simple_value=float(v))
                  for k, v in row.items() if k != "step" and isinstance(v, (int, float))]
        self.tb.add_summary(Summary(value=values), row["step"])
        self.tb.flush()
        return line

    def close(self) -> None:
        self.f.close()
        self.timeline.close()
        self.tb.close()


#: the progress line's numbers: (label, metrics key)
SHOWN = (("reward", "reward_mean"), ("kl", "kl"), ("loss", "loss"),
         ("eval acc", "eval.greedy_accuracy"),
         # multi-turn rollouts: turns per episode, share of episodes calling a tool, tool
         # errors, seconds waited for the environment, share of tokens masked
         ("turns", "rollout.turns"), ("calls", "rollout.tool_call_rate"),
         ("tool err", "rollout.tool_errors"), ("env s", "rollout.env_wait_s"),
         ("masked", "rollout.masked_share"), ("tok/s", "tokens_per_s"))


def no_signal(row: dict) -> str | None:
    """Why a step taught nothing, when every sequence's advantage was zero (a whole
    batch with one constant reward: group-relative algorithms see no difference)."""
    frac = row.get("actor.zero_advantage_frac")
    if frac == 1.0:
        reward = row.get("reward_mean")
        got = f" {reward:.4g}" if isinstance(reward, float) else ""
        return f"every sample got the same reward{got}: all advantages 0, nothing learned"
    return None


class Progress:
    """A one-line progress bar: step, reward, KL, loss, the held-out accuracy, tokens/s
    and ETA; a step that taught nothing says so on the line, and once more on a line of
    its own when it starts happening."""

    def __init__(self, total: int, start: int, stream=None):
        self.total, self.start = total, start
        self.t0 = time.monotonic()
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.quiet = False              #: the last step taught nothing (said already)
        self.eval_acc: float | None = None

    def update(self, step: int, row: dict) -> None:
        done = step + 1 - self.start
        elapsed = time.monotonic() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step - 1)
        width = 20
        fill = int(width * (step + 1) / self.total)
        parts = [f"step {step + 1}/{self.total} [{'#' * fill}{'.' * (width - fill)}]"]
        self.eval_acc = row.get("eval.greedy_accuracy", self.eval_acc)
        shown = dict(row, **({"eval.greedy_accuracy": self.eval_acc}
                             if self.eval_acc is not None else {}))
        for name, key in SHOWN:
            if key in shown and shown[key] is not None:
                parts.append(f"{name} {shown[key]:.4g}")
        parts.append(f"ETA {int(eta) // 60}m{int(eta) % 60:02d}s")
        why = no_signal(row)
        if why:
            parts.append("(no signal)")
            if not self.quiet:
                self.stream.write(("\n" if self.tty else "")
                                  + f"step {step + 1}: {why}\n")
        self.quiet = why is not None
        line = "  ".join(parts)
        if self.tty:
            self.stream.write("\r" + line.ljust(100))
            if step + 1 == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
