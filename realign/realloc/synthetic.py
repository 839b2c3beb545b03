"""Seeded synthetic full weights and their shards, for tests and benchmarks.

Each logical tensor's values depend only on (seed, content), so a tied output-layer
copy equals the embedding, and every rank builds the same full model on its own.
"""
from __future__ import annotations

import zlib

import torch

from planner.cost.transfer import Placement
from planner.specs.layout import coords_of_rank
from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import all_tensors, stage_tensors
from realign.realloc.slices import make_shard


def full_weights(spec: ModelSpec, head: str, seed: int, dtype: torch.dtype = torch.float32
                 ) -> dict[str, torch.Tensor]:
    """Content -> full tensor of random values (reproducible across processes)."""
    out = {}
    for t in all_tensors(spec, head):
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(t.content.encode()))
        out[t.content] = torch.randn(t.shape, generator=g).to(dtype)
    return out


def shards_of(full: dict[str, torch.Tensor], spec: ModelSpec, head: str, p: Placement,
              gpu: int) -> dict[str, torch.Tensor]:
    """The logical shards ``gpu`` holds in placement ``p`` (empty outside its mesh)."""
    if gpu not in p.mesh.gpus:
        return {}
    k, _d, j = coords_of_rank(gpu - p.mesh.first_gpu, p.layout)
    return {t.name: make_shard(full[t.content], t, k, p.layout.tp)
            for t in stage_tensors(spec, head, p.layout.pp, j)}
