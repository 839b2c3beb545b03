"""Fitting measured points to the cost model's terms (pure, numpy only).

* :func:`fit_relative`: non-negative least squares on relative errors: the fixed
  costs of an engine, given a design matrix built from the cost model itself (the
  cost model is linear in each fixed cost, so ``time = base + A c``); optionally
  robust (Huber), so that a probe the machine slowed does not move every fixed cost.
* :func:`fit_collective`: ``latency + factor x bytes / bandwidth`` of one collective.
* :func:`fit_transfer`: ``fixed + per_tensor x tensors + bytes / bandwidth``.

Why not scipy's ``nnls``: scipy is not a dependency. The problems here have at most a
dozen unknowns, and a simple active-set loop over numpy's ``lstsq`` (drop the negative
coefficients, solve again) suffices; unlike Lawson-Hanson it never lets a dropped
coefficient back in, so it can stop short of the exact non-negative optimum. The
robust fit is iteratively reweighted least squares over that same loop (Huber's
weights); scikit-learn's ``HuberRegressor`` and statsmodels' ``RLM`` do the weighting
but neither keeps coefficients non-negative, and neither is a dependency.
"""
from __future__ import annotations

import numpy as np

from planner.cost.profile import CollectiveCurve, TransferCosts, size_envelope
from planner.cost.rates import alg_factor


def fit_relative(A: list[list[float]], y: list[float], base: list[float] | None = None,
                 huber: float | None = None) -> tuple[list[float], float]:
    """``c >= 0`` minimising ``sum_i rho((base_i + A_i c - y_i) / y_i)``; returns ``c``
    and the RMS relative error of the fit (over every point). ``rho`` is the square, or
    with ``huber`` (a relative error) Huber's loss: square within ``huber``, linear
    beyond, so a point measured while something else held the CPU weighs like a point
    ``huber`` off rather than pulling the fit towards it. Columns that are all zero
    get 0."""
    a = np.asarray(A, dtype=float)
    t = np.asarray(y, dtype=float)
    b = np.zeros_like(t) if base is None else np.asarray(base, dtype=float)
    weight = np.ones_like(t)
    coef = _nonneg_lstsq(a, t, b, weight)
    for _ in range(50 if huber else 0):
        r = np.abs((b + a @ coef - t) / t)
        new_weight = np.where(r <= huber, 1.0, huber / np.maximum(r, 1e-300))
        if np.allclose(new_weight, weight, rtol=1e-6, atol=1e-9):
            break
        weight = new_weight
        coef = _nonneg_lstsq(a, t, b, weight)
    pred = b + a @ coef
    rms = float(np.sqrt(np.mean(((pred - t) / t) ** 2))) if len(t) else 0.0
    return [float(x) for x in coef], rms


def _nonneg_lstsq(a: np.ndarray, t: np.ndarray, b: np.ndarray, weight: np.ndarray
                  ) -> np.ndarray:
    """``c >= 0`` minimising ``sum_i weight_i ((b_i + a_i c - t_i) / t_i)^2`` (the
    active-set loop of the module's note)."""
    w = np.sqrt(weight) / t
    active = [j for j in range(a.shape[1]) if np.any(a[:, j] != 0)]
    coef = np.zeros(a.shape[1])
    while active:
        # scale the columns so the solve is well conditioned (units differ by 1e6)
        cols = a[:, active] * w[:, None]
        scale = np.linalg.norm(cols, axis=0)
        scale[scale == 0] = 1.0
        sol, *_ = np.linalg.lstsq(cols / scale, (t - b) * w, rcond=None)
        sol = sol / scale
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active = [j for j, v in zip(active, sol) if v > 0]    # drop the negative ones
    return coef


def fit_collective(op: str, group_size: int, points: list[tuple[float, float]],
                   inter_node: bool = False) -> CollectiveCurve:
    """``latency_s + alg_factor x bytes / bytes_per_s`` through the measured
    (bytes, seconds) points' :func:`~planner.cost.profile.size_envelope` (relative least
    squares, both terms >= 0); the curve keeps the measured points."""
    f = alg_factor(op, group_size)
    env = size_envelope(points)
    A = [[1.0, f * nbytes] for nbytes, _ in env]
    (lat, inv_bw), _rms = fit_relative(A, [s for _, s in env])
    if inv_bw <= 0:          # no size dependence measured: bound by the largest point
        nbytes, s = max(env)
        inv_bw = max(s - lat, 1e-12) / max(f * nbytes, 1.0)
    return CollectiveCurve(op=op, group_size=group_size, inter_node=inter_node,
                           latency_s=lat, bytes_per_s=1.0 / inv_bw,
                           points=tuple((float(b), float(s)) for b, s in points))


def fit_transfer(points: list[tuple[float, float, float, float]]) -> TransferCosts:
    """From (seconds already explained, tensors, bytes, measured seconds) points."""
    A = [[1.0, tensors, nbytes] for _, tensors, nbytes, _ in points]
    (fixed, per_tensor, inv_bw), _ = fit_relative(A, [s for *_, s in points],
                                                  [e for e, *_ in points])
    if inv_bw <= 0:
        _, _, nbytes, s = max(points, key=lambda p: p[2])
        inv_bw = max(s - fixed, 1e-12) / max(nbytes, 1.0)
    return TransferCosts(fixed_s=fixed, per_tensor_s=per_tensor, bytes_per_s=1.0 / inv_bw)
