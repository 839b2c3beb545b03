"""A sparse layer's experts applied to routed tokens: the computation after the router,
in two exact forms chosen by the number of tokens (a shape, never the routing data).

* :func:`experts_dense` (at most :data:`DENSE_MAX_TOKENS` tokens: decode steps, small
  prefills): every held expert runs on every token as one batched matmul over the
  stacked expert weights (``[E, T, h] x [E, h, 2f]``, then ``[E, T, f] x [E, f, o]``), and
  the outputs are summed with a ``[T, E]`` combine matrix holding each token's routing
  weights at its chosen experts and zeros elsewhere. Nothing is read on the host and
  every shape follows from (tokens, experts, widths), so a decode step with it is
  captured in a CUDA graph (:mod:`realign.runtime.engines.captured_step`) like a dense
  one. It computes ``E / top_k`` times the routed work, but reads each expert's weights
  once: a GPU decode step of T tokens is bound by that read while ``2 T`` flops per
  weight byte stay below the device's flops per byte (bf16 on an H100: 989 TFLOP/s over
  3.35 TB/s is about 295 tokens; an H200: about 206), hence 256.
* :func:`experts_sorted` (more tokens: training micro-batches, long prefills): the
  ``T x top_k`` (token, expert) choices sorted by expert (``argsort``), each expert's
  count from ``bincount`` read on the host once per layer (one synchronisation), and each
  expert that has rows runs its SwiGLU on its contiguous slice of the sorted rows; the
  outputs, weighted, are summed into their tokens. The work is the routed work exactly.

What the libraries almost give: megatron-core runs sorted rows in one grouped GEMM
(``TEGroupedMLP`` needs transformer-engine, ``GroupedMLP`` the ``grouped_gemm`` package),
neither installable here (docs/models.md); torch's private ``torch._grouped_mm`` is not a
stable API. Its ``SequentialMLP`` is :func:`experts_sorted`'s loop.

Both forms are differentiable and give the same values up to float rounding (the order
of the sum over a token's experts): ``tests/runtime/test_moe_experts.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: tokens up to which a layer runs :func:`experts_dense` (module docstring)
DENSE_MAX_TOKENS = 256


def dense_experts(tokens: int) -> bool:
    """Whether a layer call of ``tokens`` tokens runs :func:`experts_dense` (a function of
    the shape only). Example: a decode step of 64 rows -> True; a prefill of 16 prompts
    of 100 tokens -> False."""
    return tokens <= DENSE_MAX_TOKENS


def _swiglu(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, fc1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, fc2)


def experts_dense(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  fc1s: dict[int, torch.Tensor], fc2s: dict[int, torch.Tensor]
                  ) -> torch.Tensor:
    """Routed output [T, o] of tokens ``x`` [T, h] that chose ``experts`` [T, k] (global
    indices, all of them in ``fc1s``/``fc2s``, which hold experts ``0..E-1``) with
    ``weights`` [T, k]: every expert on every token, no host read (module docstring)."""
    n = len(fc1s)
    assert sorted(fc1s) == list(range(n)), "the dense form needs every expert"
    w1 = torch.stack([fc1s[e] for e in range(n)])           # [E, 2f, h]
    w2 = torch.stack([fc2s[e] for e in range(n)])           # [E, o, f]
    gate, up = torch.matmul(x.unsqueeze(0), w1.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2))           # [E, T, o]
    combine = torch.zeros(x.shape[0], n, dtype=weights.dtype, device=weights.device)
    combine = combine.scatter(1, experts, weights)                      # [T, E]
    return torch.einsum("te,eto->to", combine, out)


def experts_sorted(x: torch.Tensor, weights: torch.Tensor | None, experts: torch.Tensor,
                   fc1s: dict[int, torch.Tensor], fc2s: dict[int, torch.Tensor],
                   n_experts: int) -> torch.Tensor:
    """Routed output [T, o] of tokens ``x`` [T, h] that chose ``experts`` [T, k] (global
    indices among ``n_experts``; only those in ``fc1s``/``fc2s`` may occur) with
    ``weights`` [T, k] (None: unweighted, each row's output its own, ``k`` = 1): the
    choices sorted by expert, each expert's count read on the host once, each expert run
    on its slice of the sorted rows (module docstring)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()    # the one host read
    token = torch.div(order, k, rounding_mode="floor")
    rows = x[token]
    out_dim = next(iter(fc2s.values())).shape[0] if fc2s else x.shape[-1]
    pieces, start = [], 0
    for e, count in enumerate(counts):
        if count:
            pieces.append(_swiglu(rows[start:start + count], fc1s[e], fc2s[e]))
            start += count
    done = (torch.cat(pieces) if pieces
            else torch.zeros(0, out_dim, dtype=x.dtype, device=x.device))
    if weights is not None:
        done = done * weights.reshape(-1)[order, None]
    return torch.zeros(x.shape[0], out_dim, dtype=done.dtype, device=x.device).index_add(
        0, token, done)
