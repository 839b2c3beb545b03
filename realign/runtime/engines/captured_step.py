"""Decode steps captured once and replayed, so the host no longer issues every layer's
kernels on every step (``rollout.capture``).

An eager decode step (:meth:`StageDecoder.eager_step
<realign.runtime.engines.decoder.StageDecoder.eager_step>`) launches some twenty
kernels per layer from Python; on a GPU the host paces it (0.56 ms per layer and step on
an H100's host: benchmarks/gpu/README.md), however small the device's work. A capture
records one step's kernels for a fixed shape and replays them in one call:

* ``graph`` (CUDA): a ``torch.cuda.CUDAGraph`` per shape, replayed with one launch;
  every capture of a decoder shares one memory pool;
* ``compile`` (CPU): ``torch.compile`` of the eager step, one compilation per shape.
  Measured on a 2-core CPU (benchmarks/generate/README.md) it removes most of a small
  model's per-layer Python cost but gains a few per cent on the bench model, whose
  steps are arithmetic, and compiles for about a minute per shape: ``auto`` keeps the
  CPU eager;
* ``trace``: the same capture traced by ``torch.compile`` without code generation (its
  ``eager`` backend): every shape, buffer and bucket of a capture, in seconds rather
  than minutes, so the CPU tests check the capture's outputs against the eager step's.

What makes a capture reusable across steps: the KV cache is the decoder's, allocated
for the whole call; the inputs a step reads (its tokens or hidden states, the rows'
positions and cache rows) are tensors the capture owns, copied into before each
replay; the positions are tensors, so the mask and the cache writes follow them on the
device. A capture serves one shape: (rows, attended keys, every cache row or a subset).
The attended keys round up to a bucket (:func:`span_bucket`), the extra keys masked
exactly as the eager step masks its own; a subset's rows round up to a bucket
(:func:`rows_bucket`) that its caller fills with rows whose writes are harmless
(:mod:`~realign.runtime.engines.refill`). Outputs equal the eager step's: the same
operations on the same values, over a longer masked key span (greedy tokens identical,
log-probs within float rounding: ``tests/runtime/test_decode_capture.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from realign.runtime.engines.decoder import KEY_BLOCK, StageDecoder, key_span

CaptureMode = Literal["graph", "compile", "trace"]
#: ``rollout.capture``: "auto" captures where it pays (CUDA), "on" everywhere, "off" never
CaptureSetting = Literal["auto", "on", "off"]

#: attended key spans up to this many keys round up to a power of two, longer ones to a
#: multiple of it: at most twice the keys of a short step, at most this many extra keys
#: for a long one, and a few dozen captures for a 4096-token cache
SPAN_STEP = 256
#: compilations one decoder's steps may keep (torch's default, 8, would run the ninth
#: shape eagerly without saying so)
RECOMPILE_LIMIT = 512


def capture_mode(setting: CaptureSetting, device_kind: str) -> CaptureMode | None:
    """How a decode step is captured on ``device_kind`` ("cuda" | "cpu") under
    ``setting`` (None: eager). Example: ("auto", "cuda") -> "graph"; ("auto", "cpu") ->
    None; ("on", "cpu") -> "compile"."""
    if setting == "off" or (setting == "auto" and device_kind != "cuda"):
        return None
    return "graph" if device_kind == "cuda" else "compile"


def span_bucket(kv_len: int, cache_keys: int) -> int:
    """The keys a captured step attends when the step needs ``kv_len``: whole
    :data:`KEY_BLOCK` blocks rounded up to a power of two up to :data:`SPAN_STEP`, to a
    multiple of it beyond, at most the cache's ``cache_keys``. Example (cache 1024):
    40 -> 64, 200 -> 256, 300 -> 512, 1000 -> 1024."""
    need = key_span(kv_len)
    if need <= SPAN_STEP:
        span = KEY_BLOCK
        while span < need:
            span *= 2
    else:
        span = -(-need // SPAN_STEP) * SPAN_STEP
    return min(span, cache_keys)


def rows_bucket(n: int, cap: int) -> int:
    """Rows of the capture that serves a step of ``n`` rows out of ``cap``: the next
    power of two, at most ``cap``. Example: (3, 16) -> 4, (9, 12) -> 12."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap)


@dataclass
class _Capture:
    """One shape's capture: the inputs it reads and how to run it."""

    x: torch.Tensor
    pos: torch.Tensor
    rows: torch.Tensor | None
    run: Callable[[], torch.Tensor]


class CapturedSteps:
    """The decode steps of one :class:`StageDecoder` (one wave's or slot group's KV
    cache), each shape captured at its first step and replayed after."""

    def __init__(self, dec: StageDecoder, mode: CaptureMode):
        self.dec, self.mode = dec, mode
        self.captures: dict[tuple, _Capture] = {}
        self.pool = torch.cuda.graph_pool_handle() if mode == "graph" else None
        self._compiled: Callable | None = None

    def step(self, x: torch.Tensor, pos: torch.Tensor, kv_len: int,
             rows: torch.Tensor | None) -> torch.Tensor:
        """What :meth:`StageDecoder.eager_step` returns for these arguments (a tensor of
        its own, not the capture's output buffer)."""
        span = span_bucket(kv_len, self.dec.cache_keys)
        key = (tuple(x.shape), x.dtype, span, rows is None)
        cap = self.captures.get(key)
        if cap is None:
            cap = self.captures[key] = self._capture(x, pos, span, rows)
        cap.x.copy_(x)
        cap.pos.copy_(pos)
        if rows is not None:
            assert cap.rows is not None
            cap.rows.copy_(rows)
        return cap.run()

    def _capture(self, x: torch.Tensor, pos: torch.Tensor, span: int,
                 rows: torch.Tensor | None) -> _Capture:
        sx, spos = x.clone(), pos.clone()
        srows = rows.clone() if rows is not None else None
        dec = self.dec
        if self.mode in ("compile", "trace"):
            if self._compiled is None:
                self._compiled = torch.compile(
                    dec.eager_step, dynamic=False,
                    backend="inductor" if self.mode == "compile" else "eager")
            fn = self._compiled

            def compiled() -> torch.Tensor:
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                                accumulated_recompile_limit=RECOMPILE_LIMIT):
                    return fn(sx, spos, span, srows)
            return _Capture(sx, spos, srows, compiled)
        # warm-up on a side stream (library handles and workspaces are made outside the
        # capture); it writes the very cache entries the first replay writes again
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dec.eager_step(sx, spos, span, srows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = dec.eager_step(sx, spos, span, srows)

        def replay() -> torch.Tensor:
            graph.replay()
            return out.clone()      # the buffer is the next replay's output too
        return _Capture(sx, spos, srows, replay)


def capture_steps(dec: StageDecoder, mode: CaptureMode | None) -> StageDecoder:
    """``dec`` with its decode steps replayed from captures (``mode`` None: eager)."""
    if mode is not None:
        dec.replay = CapturedSteps(dec, mode)
    return dec
