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


def sparse_mlp_s(spec: ModelSpec, rows: float, tp: int, price: GemmPrice) -> float:
    """Seconds of one layer's MLP for ``rows`` tokens on one TP rank of a mixture of
    experts, the mean over its sparse and dense layers (the module docstring); 0 for a
    dense model (its MLP is among :func:`planner.cost.engine_terms.layer_gemms`)."""
    moe = spec.moe
    if moe is None or rows <= 0:
        return 0.0
    h, f = spec.hidden, moe.expert_ffn_hidden
    sparse = spec.sparse_layers() / spec.n_layers
    dense = (1.0 - sparse) * sum(price(rows, k, n) for k, n in mlp_gemms(spec, tp))
    hit = experts_hit(moe.n_experts, moe.top_k, rows)
    per = rows * moe.top_k / hit
    experts = hit * (price(per, h, 2 * f / tp) + price(per, f / tp, h))
    return dense + sparse * (price(rows, h, moe.n_experts) + experts)
