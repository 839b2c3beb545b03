"""Timed runs of realign's own engines on small probe models, on every worker of the
profile's world at once (each worker on its own device, TP = PP = DP = 1), and of the
two transfers between workers: a parameter reallocation and a record send.

The probes span what the engines' fixed costs scale with (layers, width, vocabulary,
tokens per micro-batch, micro-batches, waves, generated tokens), so that
:mod:`realign.profile.run` can fit each cost (:class:`planner.cost.profile.EngineCosts`)
through the cost model's own formulas. They are a fixed grid: never the models of an
experiment, so a profile holds for every experiment on the machine.
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec
from realign.profile.micro import device_of, sync

if TYPE_CHECKING:
    from realign.runtime.device import DeviceInfo, DeviceKind

#: (layers, hidden, vocabulary) of the probe models; head size 16, two query heads per
#: KV head, FFN twice the width
PROBE_MODELS = ((1, 32, 128), (3, 32, 128), (1, 128, 128), (3, 128, 128), (1, 128, 1024),
                (2, 256, 128))
#: the probe models run over two workers, at each of these (tp, pp, dp): a small one
#: (its collectives' fixed costs) and one whose arithmetic dominates (its ranks' lag)
MULTI_MODELS = ((2, 64, 128), (2, 256, 128))
MULTI_LAYOUTS = ((2, 1, 1), (1, 2, 1), (1, 1, 2))
#: (sequences, tokens) of a scoring or training batch, and micro-batch counts; the
#: long one separates the attention scores' cost (the square of the length) from the
#: per-token costs
SCORE_BATCHES = ((4, 8), (16, 32), (64, 16), (4, 256))
MICRO_BATCHES = (1, 2)
#: (prompts, prompt tokens), generated tokens (1: the prefill alone), waves
GEN_BATCHES = ((4, 8), (16, 16), (64, 8))
GEN_TOKENS = (1, 6)
#: on a GPU the host paces every probe (it launches kernels faster than tiny models
#: run): a deeper probe model and longer decodes separate the per-layer, per-pass and
#: per-step costs (cheap there; on CPU they would cost minutes)
GPU_PROBE_MODELS = ((8, 128, 128),)
GPU_GEN_TOKENS = (24,)
WAVES = (1, 2)
#: timed runs of a transfer probe (reallocation, record send), after one untimed
REPS = 9
#: timed runs of an engine probe per pass of the profile (after one untimed run); the
#: profile makes several passes over every probe (:mod:`realign.profile.passes`)
REPS_PER_PASS = 3


def probe_spec(layers: int, hidden: int, vocab: int) -> ModelSpec:
    heads = hidden // 16
    return ModelSpec(name=f"probe-{layers}x{hidden}v{vocab}", n_layers=layers, hidden=hidden,
                     n_heads=heads, n_kv_heads=max(1, heads // 2), ffn_hidden=2 * hidden,
                     vocab_size=vocab, max_seq_len=256)


def _device(kind: DeviceKind, dtype: str, rank: int) -> DeviceInfo:
    from realign.runtime.device import init_device
    device_of(kind, rank)
    return init_device(kind, local_rank=rank, dtype=dtype)


def build_probes(ctx, kind: DeviceKind, dtype: str) -> int:
    """Prepare this worker's device; replicas are built on first use (every worker
    takes part in creating every replica's process groups). On CPU, collective waits
    poll from now on, as a worker's do (:mod:`realign.runtime.polled_wait`)."""
    ctx.store["device"] = _device(kind, dtype, ctx.rank)
    if kind == "cpu" and "polling" not in ctx.store:
        from realign.runtime.polled_wait import polled_waits
        ctx.store["polling"] = polled_waits()
        ctx.store["polling"].__enter__()
    ctx.store["replicas"] = {}
    ctx.store["trainers"] = {}
    return ctx.rank


def _replica(ctx, dims: tuple[int, int, int], lay: tuple[int, int, int]):
    """This worker's shard of probe model ``dims`` at layout ``lay`` (tp, pp, dp): one
    replica per worker when the layout has one rank, else one replica on workers
    0..n-1 (None on the others)."""
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.model import build_model
    key = (dims, lay)
    if key not in ctx.store["replicas"]:
        dev = ctx.store["device"]
        spec = probe_spec(*dims)
        tp, pp, dp = lay
        n = tp * pp * dp
        firsts = range(dist.get_world_size()) if n == 1 else (0,)
        mine = None
        for first in firsts:
            g = build_replica_groups(spec, DeviceMesh(first_gpu=first, n_gpus=n),
                                     Layout(tp=tp, pp=pp, dp=dp))
            if g.member:
                mine = g
        ctx.store["replicas"][key] = (build_model(spec, "lm", mine, dev, seed=1)
                                      if mine is not None else None)
    return ctx.store["replicas"][key]


def _sample_times(fn, dev, ranks: list[int] | None = None, reps: int = REPS) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn`` (after one untimed); with ``ranks``,
    each sample starts once they have all lined up (a multi-rank call)."""
    fn()
    out = []
    token = torch.zeros(1)
    for _ in range(reps):
        sync(dev)
        if ranks:
            _line_up(ranks, token)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t0)
    return out


def _median_time(fn, dev, ranks: list[int] | None = None, reps: int = REPS) -> float:
    """Median seconds of ``reps`` runs of ``fn`` (see :func:`_sample_times`)."""
    return statistics.median(_sample_times(fn, dev, ranks, reps))


def _batch(spec: ModelSpec, b: int, s: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, spec.vocab_size, (b, s), generator=g)
    return {"tokens": tokens, "lengths": torch.full((b,), s),
            "prompt_lengths": torch.full((b,), max(1, s // 2)),
            "logprobs": torch.zeros(b, s - 1),
            "advantages": torch.randn(b, s - 1, generator=g)}


def _ranks(lay: tuple[int, int, int]) -> list[int] | None:
    n = lay[0] * lay[1] * lay[2]
    return list(range(n)) if n > 1 else None


def time_inference(ctx, dims, lay, b: int, s: int, m: int, reps: int = REPS_PER_PASS
                   ) -> list[float] | None:
    """Seconds of ``reps`` scoring runs (None on a worker outside the layout)."""
    from realign.runtime.engines.inference import InferenceEngine
    shard, dev = _replica(ctx, dims, lay), ctx.store["device"]
    if shard is None:
        return None
    batch = {k: v for k, v in _batch(shard.spec, b, s, 7).items() if k in ("tokens", "lengths")}
    eng = InferenceEngine(shard, micro_batches=m)
    return _sample_times(lambda: eng.inference(batch), dev.device, _ranks(lay), reps)


def time_train(ctx, dims, lay, b: int, s: int, m: int, reps: int = REPS_PER_PASS
               ) -> list[float] | None:
    """Seconds of ``reps`` optimizer steps with GRPO's actor loss (clipped surrogate)."""
    from planner.graph.algorithms import BatchShape
    from realign.algorithms import registry
    from realign.algorithms.params_table import make_params
    from realign.runtime.engines.train import TrainEngine
    from realign.runtime.settings import TrainConfig
    shard, dev = _replica(ctx, dims, lay), ctx.store["device"]
    if shard is None:
        return None
    key = (dims, lay, m)
    if key not in ctx.store["trainers"]:
        ctx.store["trainers"][key] = TrainEngine(shard, TrainConfig(lr=1e-6), micro_batches=m)
    eng = ctx.store["trainers"][key]
    algo = registry.get("grpo")
    loss = algo.loss_fn("actor", make_params(
        "grpo", {}, BatchShape(prompts_per_step=b // 2, samples_per_prompt=2)))
    batch = _batch(shard.spec, b, s, 7)
    return _sample_times(lambda: eng.train_step(batch, loss, dp_mean=False), dev.device,
                         _ranks(lay), reps)


def time_generate(ctx, dims, lay, b: int, prompt: int, n: int, waves: int,
                  reps: int = REPS_PER_PASS) -> list[float] | None:
    """Seconds of ``reps`` generation runs of ``n`` tokens after ``prompt`` tokens."""
    from realign.runtime.engines.generate import GenerateEngine
    from realign.runtime.sampling import SamplingParams
    shard, dev = _replica(ctx, dims, lay), ctx.store["device"]
    if shard is None:
        return None
    prompts = _batch(shard.spec, b, prompt, 7)["tokens"].tolist()
    params = SamplingParams(max_new_tokens=n, seed=1)
    eng = GenerateEngine(shard)
    return _sample_times(lambda: eng.generate(prompts, params, waves=waves), dev.device,
                         _ranks(lay), reps)


def time_realloc(ctx, model: tuple[int, int, int], src: tuple[int, int, int, int, int],
                 dst: tuple[int, int, int, int, int]) -> float | None:
    """Seconds of reallocating probe ``model`` from placement ``src`` to ``dst``
    ((first_gpu, n_gpus, tp, pp, dp)) on the ranks of both (None elsewhere)."""
    from realign.runtime.groups import build_replica_groups
    from realign.runtime.model import build_model
    from realign.runtime.realloc_glue import reallocate_replica
    dev = ctx.store["device"]
    spec = probe_spec(*model)
    key = ("realloc", model, src, dst)
    if key not in ctx.store:
        made = []
        for first, n, tp, pp, dp in (src, dst):
            g = build_replica_groups(spec, DeviceMesh(first_gpu=first, n_gpus=n),
                                     Layout(tp=tp, pp=pp, dp=dp))
            made.append((g, build_model(spec, "lm", g, dev) if g.member else None))
        ctx.store[key] = made
    (sg, ss), (dg, ds) = ctx.store[key]
    if not (sg.member or dg.member):
        return None

    def go():
        reallocate_replica(spec, "lm", sg, dg, ss, ds, dtype=dev.dtype,
                           gpus_per_node=dist.get_world_size())
    group = sorted(set(range(src[0], src[0] + src[1])) | set(range(dst[0], dst[0] + dst[1])))
    return _median_time(go, dev.device, group, REPS + 2)


def time_send(ctx, rows: int, cols: int, tensors: int) -> float | None:
    """Seconds of sending a record of ``tensors`` int64 tensors [rows, cols] from rank 0
    to rank 1 (:func:`realign.worker.records.send_record`); None on other ranks."""
    from realign.worker.records import recv_record, send_record
    if ctx.rank > 1:
        return None
    rec = {f"t{i}": torch.ones(rows, cols, dtype=torch.long) for i in range(tensors)}
    dev = ctx.store["device"]

    def go():
        if ctx.rank == 0:
            send_record(rec, 1)
        else:
            recv_record(0)
    return _median_time(go, dev.device, [0, 1], REPS + 2)


def _line_up(ranks: list[int], token: torch.Tensor) -> None:
    """All of ``ranks`` leave together (a gather to the first and a release from it)."""
    me, first = dist.get_rank(), ranks[0]
    if me == first:
        for r in ranks[1:]:
            dist.recv(token, r)
        for r in ranks[1:]:
            dist.send(token, r)
    else:
        dist.send(token, first)
        dist.recv(token, first)
