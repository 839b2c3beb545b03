"""The experts vLLM routed each token to, recorded during a generate call: rollout
routing replay's (R3) first half (the replay itself: :mod:`realign.runtime.router_replay`).

vLLM 0.32's own route to this (``LLM(enable_return_routed_experts=True)``, returning
``CompletionOutput.routed_experts`` [tokens, layers, top_k]) needs its Model Runner V2
(``vllm/config/vllm.py``, ``_verify_aux_output_compatibility``: "AuxOutput Connector
requires Model Runner V2"), and Model Runner V2 needs Triton with a backend for the
device (``vllm/config/vllm.py``: "Model Runner V2 requires Triton."): the CPU build has
none ("Triton is installed, but doesn't include CPU backend"), so on CPU that route
cannot start. It also requires prefix caching, which realign's engine turns off.

What this module does instead is what vLLM's own capturer does underneath
(``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``,
``bind_routed_experts_capturer``): every MoE layer's router (``BaseRouter``) calls a
capture function with the logical expert ids it chose, ``topk_ids`` [tokens, top_k],
before they are used. realign's worker extension sets that function on each layer
(:class:`RoutingCaptureExtension`); each call keeps the ids with the step's batch
layout (the requests in batch order, their rows ``query_start_loc`` and each row's
position), and :func:`routing_by_request` turns the calls into each request's experts
per (position, layer). The ids are the ones vLLM's kernels used, not recomputed.

The capture function is Python run inside vLLM's model forward (it appends to a list
and reads the ids with ``.tolist()``), so it records only where vLLM runs the forward
eagerly (``enforce_eager``: realign's engine on CPU). Under CUDA graphs or
torch.compile (realign's engine on CUDA) the function is either refused by the compiler
or runs only while a step is traced, so the decode steps would go unrecorded and a
mismatch would count prefill tokens alone: there nothing is recorded
(:func:`records_routing`) and no ``moe.routing_mismatch`` is logged.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

#: a captured call on the wire: (layer, request ids, query_start_loc, positions, topk_ids)
Call = tuple[int, list[str], list[int], list[int], list[list[int]]]


def vllm_eager(device_kind: str) -> bool:
    """Whether realign's vLLM engine on ``device_kind`` runs its forward eagerly (vLLM's
    ``enforce_eager``): on CPU; on CUDA decode runs as CUDA graphs.

    Example: ``"cpu"`` -> True, ``"cuda"`` -> False."""
    return device_kind == "cpu"


def records_routing(moe_top_k: int, enforce_eager: bool) -> bool:
    """Whether a vLLM engine records its routing: a mixture of experts (``moe_top_k`` >
    0) on an engine that runs eagerly (the capture function cannot run inside a CUDA
    graph or a compiled forward; see the module docstring).

    Example: (2, True) -> True; (2, False) -> False; (0, True) -> False."""
    return moe_top_k > 0 and enforce_eager


class RoutingCaptureExtension:
    """Mixed into vLLM's worker through realign's worker extension (``self`` is the
    worker, a V1 model runner's)."""

    def realign_route_capture(self, on: bool) -> list[int]:
        """Start (``on``) or stop recording every MoE layer's routing; the layer ids
        bound (vLLM's layer index in the model)."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = self.model_runner                                  # type: ignore[attr-defined]
        self._realign_calls: list[Call] = []
        bound = []
        for module in runner.get_model().modules():
            if not isinstance(module, MoERunner):
                continue
            if not isinstance(module.router, BaseRouter):
                raise ValueError(f"vLLM's router {type(module.router).__name__} takes no "
                                 "capture function: routing cannot be recorded")
            fn = None
            if on:
                def fn(ids: torch.Tensor, layer: int = int(module.layer_id)) -> None:
                    self._realign_calls.append(_call(runner, layer, ids))
            module.router.set_capture_fn(fn)
            bound.append(int(module.layer_id))
        return bound

    def realign_route_take(self) -> list[Call]:
        """The calls recorded since the last take (and forget them)."""
        calls = getattr(self, "_realign_calls", [])
        self._realign_calls = []
        return calls


def _call(runner, layer: int, ids: torch.Tensor) -> Call:
    """One router call's record: the batch's requests in order, their row offsets, each
    row's position in its sequence, the expert ids (rows past the batch's tokens, a
    padded step's, are dropped)."""
    n_reqs = runner.input_batch.num_reqs
    qsl = [int(x) for x in runner.query_start_loc.np[:n_reqs + 1]]
    rows = qsl[-1]
    return (layer, list(runner.input_batch.req_ids[:n_reqs]), qsl,
            runner.positions[:rows].tolist(), ids[:rows].tolist())


def external_id(internal: str) -> str:
    """vLLM's engine-core request id -> the id its output carries (the engine appends
    a random suffix after a dash). Example: ``"12-9d446ee4"`` -> ``"12"``."""
    return internal.rsplit("-", 1)[0]


def routing_by_request(calls: Sequence[Call], layers: Sequence[int]
                       ) -> dict[str, dict[int, list[list[int]]]]:
    """Each request's (by its output id) experts: position -> one row of ``top_k`` ids
    per layer of ``layers`` (vLLM's MoE layer ids, in order); a position some layer did
    not record is left out.

    Example: one call of layer 0 over requests a, b with rows [0, 2, 3] at positions
    [0, 1, 5] and ids [[1, 2], [3, 4], [5, 6]], then the same of layer 2 ->
    ``{"a": {0: [[1, 2], [1, 2]], 1: ...}, "b": {5: [[5, 6], [5, 6]]}}``."""
    index = {layer: i for i, layer in enumerate(layers)}
    seen: dict[str, dict[int, dict[int, list[int]]]] = {}
    for layer, reqs, qsl, positions, ids in calls:
        for j, req in enumerate(reqs):
            mine = seen.setdefault(external_id(req), {})
            for row in range(qsl[j], qsl[j + 1]):
                mine.setdefault(positions[row], {})[index[layer]] = ids[row]
    return {req: {pos: [per[i] for i in range(len(layers))]
                  for pos, per in sorted(by_pos.items()) if len(per) == len(layers)}
            for req, by_pos in seen.items()}


def routing_tensor(by_pos: dict[int, list[list[int]]], length: int, n_layers: int,
                   top_k: int) -> torch.Tensor:
    """One sequence's experts as [length, layers, top_k] (long; -1 at a position vLLM
    never ran forward, e.g. the last token).

    Example: {0: [[1, 2]], 1: [[3, 4]]}, length 3, 1 layer, top 2 ->
    [[[1, 2]], [[3, 4]], [[-1, -1]]]."""
    out = torch.full((length, n_layers, top_k), -1, dtype=torch.long)
    for pos, rows in by_pos.items():
        if pos < length:
            out[pos] = torch.tensor(rows, dtype=torch.long)
    return out


class VLLMRouting:
    """The host side of one engine's routing record: turns capture on when made, and
    after each generate (:meth:`take`) holds :attr:`last`, the experts of each sequence
    of the call, [prompt + generated tokens, sparse layers, top_k] (-1 where vLLM ran
    no forward: the last token). Every vLLM worker routes alike (the router is whole
    on each TP rank): the first worker's record is read."""

    def __init__(self, llm, top_k: int):
        self.llm, self.top_k = llm, top_k
        self.layers: list[int] = llm.collective_rpc("realign_route_capture", args=(True,))[0]
        if not self.layers:
            raise ValueError("the vLLM model has no MoE layer to record routing of")
        self.last: list[torch.Tensor] = []

    def take(self, outs, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The experts of each of ``outs`` (vLLM's outputs of ``prompts``)."""
        calls = self.llm.collective_rpc("realign_route_take")[0]
        by_req = routing_by_request(calls, self.layers)
        self.last = [routing_tensor(by_req.get(o.request_id, {}),
                                    len(q) + len(o.outputs[0].token_ids), len(self.layers),
                                    self.top_k) for o, q in zip(outs, prompts)]
        return self.last
