"""Decoder families: one module each (:mod:`.llama`, :mod:`.mistral`, :mod:`.qwen2`,
:mod:`.qwen3`, and the mixture of experts :mod:`.qwen3_moe`). A family says how a
Hugging Face ``config.json`` of its ``model_type`` maps onto
:class:`~planner.specs.model_spec.ModelSpec` (the config mapping), which HF tensors make
each of realign's logical tensors (the weight-name mapping, read and written through
one table) and which forward options it uses (QKV bias, per-head query/key norms, a
sliding window by default). What every family shares, and what none may have (experts
in a dense family, a rope scaling realign does not compute, sliding windows on some
layers only), is read in :mod:`planner.specs.families.base`. Adding a decoder family
is adding one module here and its line in :data:`FAMILIES`. Other mixtures of experts
(``deepseek_v3``: latent attention and sigmoid routing; ``gpt_oss``; ``mixtral``;
``qwen2_moe``: shared experts) are not among them and are refused by their
``model_type``.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from planner.specs.families import llama, mistral, qwen2, qwen3, qwen3_moe
from planner.specs.families.base import DecoderFamily


def _table(*families: DecoderFamily) -> Mapping[str, DecoderFamily]:
    out: dict[str, DecoderFamily] = {}
    for f in families:
        if f.model_type in out:
            raise ValueError(f"model_type {f.model_type!r} listed twice")
        out[f.model_type] = f
    return MappingProxyType(out)


#: every supported family by its config.json ``model_type``
FAMILIES: Mapping[str, DecoderFamily] = _table(llama.FAMILY, mistral.FAMILY, qwen2.FAMILY,
                                               qwen3.FAMILY, qwen3_moe.FAMILY)
