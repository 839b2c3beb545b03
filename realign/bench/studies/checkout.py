"""The repository checkout the studies run in: they read its experiment YAMLs, tiny
assets' sources and test helpers, and write their records under ``benchmarks/``."""
from __future__ import annotations

from pathlib import Path

#: the repository root (``realign/bench/studies/checkout.py`` three folders up)
REPO = Path(__file__).resolve().parents[3]
