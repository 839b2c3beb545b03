"""The training engines of other systems, priced: what a layer of a scoring or training
pass costs the host when it runs as a Hugging Face transformers layer, eagerly, under a
data-parallel wrapper (``train_engine`` in :class:`~planner.cost.cost_config.
CostModelConfig`). realign prices its own Megatron passes by default; these settings
price the published runs of systems that train otherwise (``benchmarks/public_runs``), so
that their estimate is the engine they ran, not realign's.

Per layer and pass, on a device that runs kernels asynchronously (the host's fixed
costs overlap the device's work: :func:`planner.cost.engine_terms.overlapped`):

* ``hf`` (DeepSpeed ZeRO-1/2, DDP: the weights stay whole on every rank): the layer's
  kernels launched one by one from Python, as in an eager decode step: the device's
  eager per-layer cost, ``decode_layer_overhead_s`` (docs/gpu-facts.md §3a: a naive eager
  loop over a 7B model's 32 layers on an A100 host, 39 ms per token, 1.2 ms a layer);
  a training pass counts a forward and a backward as three forwards, as realign's own
  engine does (``layer_overhead_s`` x 3);
* ``hf_sharded`` (PyTorch FSDP with each decoder layer its own unit, DeepSpeed ZeRO-3):
  the same, plus the sharded wrapper's hook around each unit that gathers its weights
  (and in the backward gathers them again and reduce-scatters its gradients), run on the
  host before the unit's kernels: :data:`SHARDED_UNIT_HOOK_S` per unit and hook, one
  hook in a forward (pre-forward), three in a training pass (pre-forward, pre-backward,
  post-backward).
"""
from __future__ import annotations

from typing import Literal

from planner.specs.layout import Layout

#: The engine of the scoring and training calls (``train_engine``).
TrainEngine = Literal["own", "hf", "hf_sharded"]

#: Host seconds of one sharded data-parallel unit's hook (its weights' all-gather
#: issued, the flat parameter's views set up, the stream synchronisations): "1 ms
#: launches" of ``FSDP::pre_forward`` per unit, "50% of the step time", CPU-bound on "a
#: standard over-provisioned Xeon machine" (pytorch/pytorch issue #173680, FSDP2, torch
#: 2.10; docs/gpu-facts.md §2d).
SHARDED_UNIT_HOOK_S = 1.0e-3

#: hooks per unit in an inference pass and in a training pass (forward + backward)
HOOKS_PER_PASS = {"inference": 1.0, "train": 3.0}


def peer_layer_s(engine: TrainEngine, kind: str, eager_layer_s: float) -> float | None:
    """Host seconds per layer of one ``kind`` (train | inference) pass of a micro-batch on
    ``engine``, with ``eager_layer_s`` the device's eager per-layer cost
    (``decode_layer_overhead_s``); None for realign's own engine (its preset's
    ``layer_overhead_s`` applies) and for other kinds.

    Example: hf_sharded, train, 1.2 ms eager: 3 x 1.2 ms + 3 x 1 ms = 6.6 ms."""
    if engine == "own" or kind not in HOOKS_PER_PASS:
        return None
    forwards = 3.0 if kind == "train" else 1.0
    hooks = HOOKS_PER_PASS[kind] if engine == "hf_sharded" else 0.0
    return forwards * eager_layer_s + hooks * SHARDED_UNIT_HOOK_S


def train_engine_options(engine: TrainEngine, layout: Layout) -> tuple[str, ...]:
    """The engines a scoring or training call is priced on under ``layout``: realign's
    own (``own``) at any layout; another system's trainer (data parallel only: these
    trainers have no tensor, pipeline or expert parallelism) at TP 1, PP 1, EP 1, none
    elsewhere (its call is priced as ``own``, the engine of the estimate).

    Example: hf_sharded at tp 2 -> (); at tp 1, pp 1 -> ("own",); own at tp 2 -> ("own",)."""
    flat = layout.tp == 1 and layout.pp == 1 and layout.ep == 1
    return ("own",) if engine == "own" or flat else ()
