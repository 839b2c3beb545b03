"""``realign profile``: measure this machine and write its profile table.

One worker process per device (the runs' thread count each) measures at once, so
every rate includes what the devices' sharing of the machine costs (memory
bandwidth, caches). Steps, with a progress bar:

1. GEMM rates over a grid of rows x width, forward and forward + backward;
2. streaming memory bandwidth;
3. collectives (all-reduce, all-gather, reduce-scatter, broadcast, all-to-all over
   each power of two of workers, and point to point) by message size, fitted to latency +
   bytes / bandwidth;
4. realign's engines on probe models (:mod:`realign.profile.engines`): scoring,
   training, generation; their fixed costs (:class:`planner.cost.profile.EngineCosts`) are
   fitted through the cost model itself: the cost model is linear in each fixed cost,
   so pricing each probe with each cost set to 1 (the rest 0) gives the design matrix
   of a non-negative least-squares fit on relative errors (on a GPU, where a pass
   costs the longer of host and device work, the host's costs alone: see
   :func:`fit_engines`);
5. a parameter reallocation and a record send between two workers, fitted to a
   fixed cost and a throughput.

Collectives across nodes need workers on several nodes (a launcher); this command
measures one node, and the table says so (its curves are all ``inter_node: false``).
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.engine_terms import FIXED, HOST_FIXED
from planner.cost.profile import EngineCosts, GemmGrid, ProbePoint, ProfileTable, Provenance
from planner.cost.rates import Rates
from planner.cost.realloc_cost import ReallocModel, realloc_recv_send
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from realign.profile import engines as E
from realign.profile.fit import fit_collective, fit_relative, fit_transfer
from realign.profile.passes import DEFAULT_PASSES, cellwise, pass_time_ratios, pooled_median
from realign.profile.step_overhead import measure_step_costs

GRIDS = {   # (rows, widths) of the GEMM grid per device kind
    "cpu": ((1, 4, 16, 64, 256, 1024, 4096), (16, 32, 64, 128, 256, 512, 1024)),
    "cuda": ((1, 8, 64, 256, 1024, 4096, 16384), (64, 256, 1024, 2048, 4096, 8192)),
}
COLLECTIVE_BYTES = (4, 256, 4096, 65536, 1 << 20, 8 << 20, 32 << 20)
MEM_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}


@dataclass(frozen=True)
class ProfileSettings:
    device: str = "cpu"            #: cpu | cuda
    preset: str = "cpu"            #: the device preset the table is for
    workers: int = 2               #: one per device, measured at once
    threads: int = 1               #: CPU threads per worker (the runs' launcher setting)
    dtype: str = "fp32"
    passes: int = DEFAULT_PASSES   #: passes over the GEMM grid and the engine probes


class Progress:
    """A progress bar on ``out``: one line rewritten on a terminal, else a line per step."""

    def __init__(self, out, total: float):
        self.out, self.total, self.done = out, total, 0.0
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.t0 = time.perf_counter()

    def step(self, what: str, weight: float = 0.0) -> None:
        self.done += weight
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
        line = (f"realign profile [{bar}] {frac:4.0%}  {time.perf_counter() - self.t0:5.0f} s  "
                f"{what}")
        if self.tty:
            print(f"\r{line:<100}", end="" if frac < 1 else "\n", file=self.out, flush=True)
        else:
            print(line, file=self.out, flush=True)


def _probe_samples(per_rank: list[list[float]], layout: tuple[int, int, int]) -> list[float]:
    """One pass's samples of a probe from its workers' answers: on one worker alone, the
    mean over the workers of each sample (each measured its own replica at the same
    time); over several, the first rank's, as a run reports it."""
    if layout == (1, 1, 1):
        return [sum(xs) / len(xs) for xs in zip(*per_rank)]
    return per_rank[0]


def profile_machine(settings: ProfileSettings, out=sys.stderr) -> ProfileTable:
    """Measure and fit; the finished table. The GEMM grid and the engine probes are
    measured in ``settings.passes`` passes spread over the profile, each probe's
    samples pooled over them (:mod:`realign.profile.passes`)."""
    from realign.runtime.local_world import LocalWorld
    s = settings
    t_start = time.time()
    probes = _probes(s.workers, s.device)
    n_probes = sum(len(v) for v in probes.values())
    prog = Progress(out, 100.0)
    prog.step(f"starting {s.workers} workers ({s.threads} thread(s) each, {s.device}, {s.dtype})")
    with LocalWorld(s.workers, threads=s.threads, timeout_s=600.0, device=s.device) as world:
        rows, widths = GRIDS[s.device]
        fwd, trn = [], []
        samples: dict[str, list[list[list[float]]]] = {k: [[] for _ in v]
                                                       for k, v in probes.items()}
        done = 2.0
        for p in range(s.passes):
            tag = f"pass {p + 1}/{s.passes}: " if s.passes > 1 else ""
            prog.step(f"{tag}GEMM grid", done)
            grids = world.run("realign.profile.micro:gemm_grid", s.device, s.dtype,
                              list(rows), list(widths))
            fwd.append(cellwise([g[0] for g in grids], statistics.fmean))
            trn.append(cellwise([g[1] for g in grids], statistics.fmean))
            done = 15 / s.passes
            if p == 0:
                prog.step("memory bandwidth and host link", done)
                bws = world.run("realign.profile.micro:mem_bandwidth", s.device,
                                MEM_BYTES[s.device])
                mem = sum(bws) / len(bws)
                links = [b for b in world.run("realign.profile.micro:host_link_bandwidth",
                                              s.device, MEM_BYTES[s.device]) if b is not None]
                prog.step("collectives", 5)
                coll = world.run("realign.profile.micro:collectives", s.device,
                                 list(COLLECTIVE_BYTES))[0]
                prog.step("probe models", 10)
                world.run("realign.profile.engines:build_probes", s.device, s.dtype)
                done = 0.0
            for kind, cases in probes.items():
                for k, (fn, args, _mfc) in enumerate(cases):
                    prog.step(f"{tag}engine {kind} {k + 1}/{len(cases)}", done)
                    done = 50 / (n_probes * s.passes)
                    per_rank = [t for t in world.run(fn, *args) if t is not None]
                    samples[kind][k].append(_probe_samples(per_rank, args[1]))
        gemm = GemmGrid(rows=rows, widths=widths, forward_flops_per_s=cellwise(fwd),
                        train_flops_per_s=cellwise(trn))
        curves = []
        for key, pts in coll.items():
            op, n = key.split()
            if pts:
                curves.append(fit_collective(op, int(n), pts))
        base = ProfileTable(device=s.preset, gemm=gemm, mem_bytes_per_s=mem,
                            host_link_bytes_per_s=sum(links) / len(links) if links else None,
                            collectives=tuple(curves))
        fitted, rms, points = {}, {}, []
        for kind, cases in probes.items():
            measured = [pooled_median(x) for x in samples[kind]]
            costs, err, pred = fit_engines(base, s, kind, cases, measured)
            fitted.update(costs)
            rms[kind] = err
            points += [ProbePoint(engine=kind, model=a[0], layout=a[1], args=a[2:],
                                  measured_s=t, fitted_s=f)
                       for (_fn, a, _c), t, f in zip(cases, measured, pred)]
        ratios = pass_time_ratios([x for v in samples.values() for x in v])
        prog.step("reallocation", done)
        realloc = _realloc(world, s, mem)
        prog.step("record send", 6)
        send = _send(world)
    from realign.run.vllm_check import vllm_installed
    vllm_load = None
    if vllm_installed():
        from realign.profile.vllm_probe import fit_vllm, fit_vllm_load, probe_points, time_vllm
        prog.step("vLLM's prefill and decode steps (vLLM is installed)", 3)
        timed, loads = time_vllm(s.device, s.dtype, s.threads)
        vllm_load = fit_vllm_load(loads)
        cluster, cfg = _fit_cluster(s)
        vllm_costs, rms["vllm"], pred = fit_vllm(base, cluster, cfg.param_dtype_bytes, timed)
        fitted.update(vllm_costs)
        points += probe_points(timed, pred)
    prog.step(f"a run's own step cost: tiny runs on 1 and {s.workers} worker(s)", 6)
    with tempfile.TemporaryDirectory(prefix="realign-profile-") as tmp:
        step = measure_step_costs(Path(tmp), s.workers, s.device, s.preset, s.threads, s.dtype)
    import torch

    import realign
    table = base.model_copy(update={
        "engines": fitted, "realloc": realloc, "send": send, "step": step,
        "vllm_load": vllm_load,
        "measured": Provenance(
            host=platform.node(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), workers=s.workers, threads_per_worker=s.threads,
            dtype=s.dtype, torch=torch.__version__, realign=realign.__version__,
            duration_s=time.time() - t_start, fit_rms_relative_error=rms,
            probes=tuple(points), passes=s.passes, pass_time_ratios=tuple(ratios))})
    prog.step("done", 6)
    return ProfileTable.model_validate(table.model_dump())


# ---- engine probes and their fit ---------------------------------------------------

def _probes(workers: int, device: str = "cpu") -> dict[str, list[tuple[str, tuple, tuple]]]:
    """kind -> [(function, its args, (probe model, layout, MFC, micro-batches))]: every
    probe model on each worker alone (on cuda also :data:`~realign.profile.engines.
    GPU_PROBE_MODELS`), and the multi-rank probe models (:data:`~realign.profile.
    engines.MULTI_MODELS`) alone (their one-device baselines) and over two workers at
    TP2, PP2 and DP2."""
    out: dict[str, list] = {"inference": [], "train": [], "generate": []}
    gpu = device == "cuda"
    setups = [(dims, (1, 1, 1)) for dims in dict.fromkeys(
        E.PROBE_MODELS + E.MULTI_MODELS + (E.GPU_PROBE_MODELS if gpu else ()))]
    if workers >= 2:
        setups += [(dims, lay) for dims in E.MULTI_MODELS for lay in E.MULTI_LAYOUTS]
    for dims, lay in setups:
        for b, n in E.SCORE_BATCHES:
            for m in E.MICRO_BATCHES:
                inf = MFC(name="probe.inference", role="ref", kind="inference", n_seqs=b,
                          prompt_len=n, gen_len=0, input_keys=("x",), output_keys=("y",))
                out["inference"].append(("realign.profile.engines:time_inference",
                                         (dims, lay, b, n, m), (dims, lay, inf, m)))
                tr = MFC(name="probe.train", role="actor", kind="train", n_seqs=b,
                         prompt_len=n, gen_len=0, input_keys=("x",), output_keys=("y",))
                out["train"].append(("realign.profile.engines:time_train",
                                     (dims, lay, b, n, m), (dims, lay, tr, m)))
        for b, p in E.GEN_BATCHES:
            for n in E.GEN_TOKENS + (E.GPU_GEN_TOKENS if gpu else ()):
                for w in E.WAVES:
                    gen = MFC(name="probe.generate", role="actor", kind="generate", n_seqs=b,
                              prompt_len=p, gen_len=n, input_keys=("x",), output_keys=("y",))
                    out["generate"].append(("realign.profile.engines:time_generate",
                                            (dims, lay, b, p, n, w), (dims, lay, gen, w)))
    return out


def _fit_cluster(s: ProfileSettings) -> tuple[ClusterSpec, CostModelConfig]:
    cluster = ClusterSpec(n_nodes=1, gpus_per_node=s.workers, device=resolve_device(s.preset))
    cfg = CostModelConfig(param_dtype_bytes=2 if s.dtype == "bf16" else 4,
                          distributed_optimizer=False)
    return cluster, cfg


#: beyond this relative error a probe weighs linearly in the engine fit (Huber): on a
#: shared CPU a two-worker probe can run 2-3x slow now and then (gloo's ranks wait for
#: a core); a least-squares fit would let such a probe raise every fixed cost of its
#: engine
FIT_HUBER = 0.1


def fit_engines(base: ProfileTable, s: ProfileSettings, kind: str, cases: list,
                measured: list[float]) -> tuple[dict[str, EngineCosts], float, list[float]]:
    """The fixed costs of ``kind``'s engine(s) (generate: prefill and decode) that best
    explain ``measured`` through the cost model; the fit's RMS relative error; and the
    fitted time of each probe (priced as plans are, overlap included).

    On a device that runs kernels asynchronously (a GPU) the probe models are so small
    that the host paces every probe: the fit explains each measured time by the host's
    fixed costs (:data:`~planner.cost.engine_terms.HOST_FIXED`) alone, and the costs that
    price device memory traffic keep their analytic values (the measured bandwidth);
    fitted to these probes they would take up host time and then charge it per token
    and per parameter of far larger models."""
    cluster, cfg = _fit_cluster(s)
    kinds = ("prefill", "decode") if kind == "generate" else (kind,)
    overlap = cluster.device.async_kernels
    # the fit solves the linear model: fixed costs summed with the device's work
    linear = cluster.model_copy(update={"device": cluster.device.model_copy(
        update={"async_kernels": False})})
    fields: tuple[str, ...]
    if overlap:
        analytic = Rates(cluster, cfg, base.model_copy(update={"engines": {}}))
        zero = {k: analytic.engine(k).model_copy(update={f: 0.0 for f in HOST_FIXED})
                for k in ("train", "inference", "prefill", "decode")}
        fields = HOST_FIXED
    else:
        zero = {k: EngineCosts() for k in ("train", "inference", "prefill", "decode")}
        fields = FIXED
    unknowns = [(k, f) for k in kinds for f in fields]

    def price(engines, where: ClusterSpec) -> list[float]:
        cm = CostModel(where, cfg, base.model_copy(update={"engines": engines}))
        out = []
        for _fn, _args, (dims, (tp, pp, dp), mfc, m) in cases:
            spec = E.probe_spec(*dims)
            out.append(cm.mfc_cost(mfc, spec, "lm", DeviceMesh(first_gpu=0, n_gpus=tp * pp * dp),
                                   Layout(tp=tp, pp=pp, dp=dp), m).time_s)
        return out
    t0 = price(zero, linear)
    cols = []
    for k, f in unknowns:
        unit = price({**zero, k: zero[k].model_copy(update={f: 1.0})}, linear)
        cols.append([u - z for u, z in zip(unit, t0)])
    A = [[c[i] for c in cols] for i in range(len(cases))]
    coef, rms = fit_relative(A, measured, [0.0] * len(cases) if overlap else t0,
                             huber=FIT_HUBER)
    costs = {k: zero[k].model_copy(update={f: c for (kk, f), c in zip(unknowns, coef) if kk == k})
             for k in kinds}
    if not overlap:
        pred = [z + sum(a * c for a, c in zip(row, coef)) for z, row in zip(t0, A)]
        return costs, rms, pred
    pred = price({**zero, **costs}, cluster)
    rms = math.sqrt(sum(((p - m) / m) ** 2 for p, m in zip(pred, measured)) / len(pred))
    return costs, rms, pred


# ---- transfers ---------------------------------------------------------------------

#: reallocations measured (probe model, source, destination): all bytes over the wire,
#: all local, and half and half
REALLOCS = ((E.PROBE_MODELS[3], (0, 1, 1, 1, 1), (1, 1, 1, 1, 1)),
            (E.PROBE_MODELS[4], (0, 1, 1, 1, 1), (1, 1, 1, 1, 1)),
            (E.PROBE_MODELS[3], (0, 2, 1, 1, 2), (0, 2, 2, 1, 1)),
            (E.PROBE_MODELS[3], (0, 2, 2, 1, 1), (0, 1, 1, 1, 1)),
            (E.PROBE_MODELS[4], (0, 2, 2, 1, 1), (0, 1, 1, 1, 1)))
#: records sent: (rows, columns, tensors)
SENDS = ((4, 8, 1), (4, 8, 3), (64, 64, 1), (64, 64, 3), (256, 512, 1), (256, 512, 3))


def _realloc(world, s: ProfileSettings, mem: float):
    if s.workers < 2:
        return None
    dt = 2 if s.dtype == "bf16" else 4
    pts = []
    for model, src, dst in REALLOCS:
        times = [t for t in world.run("realign.profile.engines:time_realloc", model, src, dst)
                 if t is not None]
        rm = ReallocModel.of(E.probe_spec(*model), "lm", dt)
        acc = realloc_recv_send(rm, src, dst, s.workers)
        gpus = set(acc.recv) | set(acc.local)
        g = max(gpus, key=lambda x: (sum(acc.recv.get(x, [0, 0])), acc.local.get(x, 0)))
        wire = sum(acc.recv.get(g, [0, 0]))
        copy = (wire + acc.local.get(g, 0)) / mem
        pts.append((copy, 0.0, float(wire), max(times)))
    return fit_transfer(pts)


def _send(world):
    if world.n < 2:
        return None
    pts = []
    for rows, cols, tensors in SENDS:
        times = [t for t in world.run("realign.profile.engines:time_send", rows, cols, tensors)
                 if t is not None]
        pts.append((0.0, float(tensors), float(rows * cols * 8 * tensors), max(times)))
    return fit_transfer(pts)


def default_settings(device: str, workers: int | None, threads: int, dtype: str | None,
                     preset: str | None, passes: int = DEFAULT_PASSES) -> ProfileSettings:
    """Settings from the command line's choices (defaults: this machine)."""
    if device == "cuda":
        import torch
        n = workers or torch.cuda.device_count()
        name = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else ""
        guess = next((p for k, p in (("h200", "h200"), ("h100", "h100-80g"),
                                     ("a100", "a100-80g")) if k in name), None)
        return ProfileSettings("cuda", preset or guess or "h100-80g", n, threads,
                               dtype or "bf16", passes)
    n = workers or max(1, (os.cpu_count() or 1) // threads)
    return ProfileSettings("cpu", preset or "cpu", n, threads, dtype or "fp32", passes)
