"""The state of the machine a benchmark ran on: load, CPU time the hypervisor stole,
versions. Other work on the machine, or on the host of a virtual machine, skews every
number a benchmark takes; these let a record say so beside its numbers."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path

#: A round counts towards a headline only if the hypervisor stole at most this share of
#: the CPU time during each of its parts: stolen time slows two compared sides unequally
#: (TRL's OpenMP threads far more), so such a round measures the host, not the trainers.
STEAL_LIMIT = 0.02


def _ver(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_snapshot() -> dict:
    """1/5/15-minute load averages and the CPU time counters: other work on the machine,
    or on the host of a virtual machine (steal time), skews every number here."""
    la = os.getloadavg() if hasattr(os, "getloadavg") else (None, None, None)
    return {"loadavg_1m": la[0], "loadavg_5m": la[1], "loadavg_15m": la[2],
            "unix_s": time.time(), "cpu_ticks": _cpu_ticks()}


def _cpu_ticks() -> dict[str, int] | None:
    """The machine's total and stolen CPU time (``/proc/stat``, clock ticks); None where
    there is no such file."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return {"total": sum(fields[:8]), "steal": fields[7] if len(fields) > 7 else 0}


def steal_fraction(before: dict, after: dict) -> float | None:
    """Share of the CPU time between two :func:`load_snapshot` snapshots that the hypervisor
    gave to other machines (0 on bare metal)."""
    a, b = before.get("cpu_ticks"), after.get("cpu_ticks")
    if not a or not b or b["total"] <= a["total"]:
        return None
    return (b["steal"] - a["steal"]) / (b["total"] - a["total"])


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "sched_affinity_cpus": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else None,
            "realign": {p: _ver(p) for p in ("realign", "torch", "megatron-core",
                                             "transformers")}}


def describe() -> dict:
    """The machine a record was taken on, as every study writes it: :func:`environment`
    (platform, CPU counts, Python and package versions) and the CPU's model name."""
    return {**environment(), "cpu": cpu_model()}


def clean_rounds(rounds: list[dict], limit: float = STEAL_LIMIT) -> list[int]:
    """Indices of the rounds whose every part had at most ``limit`` of its CPU time
    stolen (a part whose steal is unknown, without ``/proc/stat``, counts as clean)."""
    return [i for i, r in enumerate(rounds)
            if all(v is None or v <= limit for v in r.get("steal_fraction", {}).values())]
