"""What pricing one MFC under one allocation gives: :class:`MFCCost`, its time by term
and its memory per GPU. The cost model (:mod:`planner.cost.cost_model`) and the pricers
it delegates to (:mod:`planner.cost.turns`, :mod:`planner.cost.vllm_cost`) return it;
the search reads it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MFCCost:
    """Time and memory of one MFC under one allocation."""

    time_s: float
    terms_s: dict[str, float]          #: time by term (gemm, tp_comm, fixed, bubble, ...)
    weights_bytes: float               #: this layout's weights on the heaviest GPU
    #: state kept between calls (train: weights+grads+optimizer; with state offload: weights)
    resident_bytes: float
    activation_bytes: float            #: transient working memory during the call
    host_bytes: float = 0.0            #: host memory per GPU held for it (offloaded state)
    #: the LoRA adapters among ``weights_bytes`` (what a reallocation moves once the
    #: frozen base is in place; 0 without LoRA)
    adapter_bytes: float = 0.0


@dataclass(frozen=True)
class MFCBytes:
    """The memory per GPU of one MFC under one allocation, without its time: the
    fields of :class:`MFCCost` of the same name (:meth:`planner.cost.cost_model.CostModel.
    mfc_bytes` gives them alike), so a caller that drops what does not fit prices the
    time of what does only."""

    weights_bytes: float
    resident_bytes: float
    activation_bytes: float
    host_bytes: float
    adapter_bytes: float
    #: a train call with training-state offload: the state the GPU keeps during the call
    #: that comes up from host memory before it and goes down after (0 otherwise)
    kept_bytes: float = 0.0
