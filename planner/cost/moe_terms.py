"""What a mixture of experts adds to a layer's price (:class:`~planner.specs.model_spec.MoeSpec`):
compute is set by the experts a token uses, memory traffic by the experts a pass touches.

On a sparse layer each of ``rows`` tokens is scored by the router (``[hidden, experts]``,
whole on every TP rank) and sent to ``top_k`` experts. Uniform routing spreads the
``rows x top_k`` token-expert pairs over the experts: a pass touches on average

    hit = n_experts x (1 - (1 - top_k / n_experts) ** rows)

of them (each expert is missed by all ``rows`` tokens with probability
``(1 - k/n)^rows``), each with ``rows x top_k / hit`` tokens. The experts' GEMMs are
priced as ``hit`` GEMMs of that many rows through one expert's TP shard
(:meth:`planner.cost.rates.Rates.gemm_s`: FLOPs of the active experts only, weight bytes
of the experts touched). So a prefill of many tokens pays for reading every expert once
and for the top-k experts' FLOPs; a decode step of a few rows reads only the experts its
rows chose, which is where a mixture of experts is cheaper than a dense model of its
total size. Layers that keep the dense MLP (``dense_layers``) are priced as the dense
MLP; the layer price is the mean over the model's layers.

Example: 128 experts, top 8, 1 token -> 8 experts hit; 16 tokens -> 82.4; 64 tokens ->
125.9; 4096 tokens -> 128.

Expert parallelism (``ep`` > 1, :class:`~planner.specs.layout.Layout`): an EP rank holds
``n_experts / ep`` experts and runs them on the tokens its EP group's ``ep`` ranks route
to them. Uniform routing sends it ``rows x top_k`` token-expert pairs again (a share
``1/ep`` of the group's ``ep x rows x top_k``), over the

    hit = n_experts / ep x (1 - (1 - top_k / n_experts) ** (ep x rows))

of its experts the group's tokens touch: the same FLOPs, fewer experts read, each on
more rows. The tokens travel by two all-to-alls per sparse layer and pass (dispatch to
the experts' ranks, combine back; a training pass has both again in its backward): each
rank sends :func:`ep_exchange_bytes`, ``rows x top_k x hidden x dtype bytes x
(ep - 1)/ep`` (the pairs whose expert another rank holds), priced by
:meth:`planner.cost.rates.Rates.all_to_all_s` over the EP group's nodes.
"""
from __future__ import annotations

from typing import Callable

from planner.specs.model_spec import ModelSpec

#: seconds of a ``[rows, k] x [k, n]`` GEMM under the pass's convention (forward,
#: forward + backward, or a frozen weight's two forward GEMMs)
GemmPrice = Callable[[float, float, float], float]


def experts_hit(n_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` tokens route to, each choosing ``top_k`` of
    ``n_experts`` (uniform routing). ``experts_hit(128, 8, 1) == 8``."""
    if tokens <= 0:
        return 0.0
    return n_experts * (1.0 - float((1.0 - top_k / n_experts) ** tokens))


def mlp_gemms(spec: ModelSpec, tp: int) -> list[tuple[float, float]]:
    """(K, N) of the dense MLP's GEMMs on one TP rank: FC1 (gate and up), FC2."""
    h, f = spec.hidden, spec.ffn_hidden
    return [(h, 2 * f / tp), (f / tp, h)]


def local_experts_hit(n_experts: int, top_k: int, rows: float, ep: int) -> float:
    """Expected distinct experts of one EP rank (``n_experts / ep`` of them) that the
    ``ep x rows`` tokens of its EP group route to. ``ep`` 1: :func:`experts_hit`.

    Example: 128 experts, top 8, ep 4, 1 token per rank -> 32 x (1 - (15/16)^4) = 7.27."""
    if rows <= 0:
        return 0.0
    return n_experts / ep * (1.0 - float((1.0 - top_k / n_experts) ** (ep * rows)))


def ep_exchange_bytes(spec: ModelSpec, rows: float, ep: int, dtype_bytes: int) -> float:
    """Bytes one rank sends in one all-to-all of expert parallelism (a dispatch or a
    combine) for ``rows`` tokens: ``rows x top_k x hidden x dtype x (ep - 1)/ep``; 0
    without experts or at ``ep`` 1.

    Example: 4096 tokens, top 8, hidden 2048, bf16, ep 8: 4096 x 8 x 2048 x 2 x 7/8 =
    117,440,512 bytes."""
    if spec.moe is None or ep <= 1:
        return 0.0
    return rows * spec.moe.top_k * spec.hidden * dtype_bytes * (ep - 1) / ep


def sparse_mlp_s(spec: ModelSpec, rows: float, tp: int, price: GemmPrice, ep: int = 1) -> float:
    """Seconds of one layer's MLP for ``rows`` tokens on one TP rank of a mixture of
    experts, the mean over its sparse and dense layers (the module docstring), its
    ``n_experts / ep`` experts on the tokens routed to them; 0 for a dense model (its
    MLP is among :func:`planner.cost.engine_terms.layer_gemms`)."""
    moe = spec.moe
    if moe is None or rows <= 0:
        return 0.0
    h, f = spec.hidden, moe.expert_ffn_hidden
    sparse = spec.sparse_layers() / spec.n_layers
    dense = (1.0 - sparse) * sum(price(rows, k, n) for k, n in mlp_gemms(spec, tp))
    hit = (experts_hit(moe.n_experts, moe.top_k, rows) if ep == 1
           else local_experts_hit(moe.n_experts, moe.top_k, rows, ep))
    per = rows * moe.top_k / hit
    experts = hit * (price(per, h, 2 * f / tp) + price(per, f / tp, h))
    return dense + sparse * (price(rows, h, moe.n_experts) + experts)
