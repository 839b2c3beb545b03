"""Every algorithm's parameters as one table: the tagged union the experiment schema
reads ``algorithm.params`` into (:data:`AnyParams`), the class of each algorithm
(:data:`PARAMS`) and :func:`make_params`, which builds one from the experiment's keys and
the fields its batch shape owns."""
from __future__ import annotations

from typing import Annotated, Any, Mapping, Union

from pydantic import Field, ValidationError

from planner.errors import UserError, from_validation
from planner.graph.algorithms import BatchShape
from realign.algorithms.param_paths import SHAPE_OWNED
from realign.algorithms.params import (
    AlgorithmParams,
    DAPOConfig,
    DPOConfig,
    DrGRPOConfig,
    GRPOConfig,
    GSPOConfig,
    OnlineDPOConfig,
    PPOConfig,
    ReinforcePPConfig,
    RejectionSamplingConfig,
    ReMaxConfig,
    RLOOConfig,
    RMConfig,
    SFTConfig,
)

#: every algorithm's parameters, told apart by their ``algorithm``
AnyParams = Annotated[Union[PPOConfig, GRPOConfig, ReMaxConfig, ReinforcePPConfig,
                            RLOOConfig, DPOConfig, SFTConfig, RMConfig,
                            RejectionSamplingConfig, OnlineDPOConfig, DAPOConfig, GSPOConfig,
                            DrGRPOConfig],
                      Field(discriminator="algorithm")]

#: algorithm name -> its parameters' class
PARAMS: Mapping[str, type[AlgorithmParams]] = {
    c.model_fields["algorithm"].default: c
    for c in (PPOConfig, GRPOConfig, ReMaxConfig, ReinforcePPConfig, RLOOConfig, DPOConfig,
              SFTConfig, RMConfig, RejectionSamplingConfig, OnlineDPOConfig, DAPOConfig,
              GSPOConfig, DrGRPOConfig)}


def make_params(name: str, params: Mapping[str, Any], shape: BatchShape) -> AlgorithmParams:
    """Algorithm ``name``'s parameters from the experiment's ``algorithm.params`` and the
    fields its batch shape owns; a :class:`UserError` naming ``algorithm.params.<key>``
    (or ``algorithm.<key>`` for a batch-shape field) when a value is not allowed."""
    cls = PARAMS[name]
    for key, owner in {**SHAPE_OWNED, "algorithm": "name"}.items():
        if key in params:
            raise UserError(f"set {owner} on the algorithm, not in params",
                            field=f"algorithm.params.{key}")
    from_shape = {k: getattr(shape, v) for k, v in SHAPE_OWNED.items()
                  if k in cls.model_fields}
    try:
        out = cls(**params, **from_shape)
    except ValidationError as e:
        raise from_validation(e, cls, prefix="algorithm.params",
                              unknown=f"unknown hyper-parameter of {name}",
                              hidden=("algorithm", *from_shape),
                              renames={k: f"algorithm.{SHAPE_OWNED[k]}" for k in from_shape}
                              ) from None
    out.check_written(set(params))
    return out
