"""The rates the cost model prices with: GEMM speed, memory bandwidth, collectives,
transfers and the fixed costs of realign's engines, each taken from a measured
:class:`~planner.cost.profile.ProfileTable` where it has the term, else derived from the
device preset (whose numbers cite ``docs/gpu-facts.md``). :attr:`Rates.sources`
says which, per term, so a plan can show what was measured.

Analytic terms (no profile):

* GEMM ``[M, K] x [K, N]`` (units: seconds): a roofline, ``max(F / (R w/(w + w_half)),
  B / B_mem)`` with ``F = 2 M K N`` FLOPs (x3 forward + backward), ``R`` = peak FLOP/s x
  ``matmul_efficiency``, ``w = sqrt(K N)`` and ``B = (K N + M (K + N))`` elements x dtype
  bytes (x3 in training). A GEMM of few rows is memory-bound: batch-1 decode streams its
  weights at the memory bandwidth, it is not priced as compute.
* collectives on ``n`` ranks over ``N`` nodes (``k = n / N`` per node), ``S`` the
  tensor's bytes, ``B_i`` / ``B_x`` the intra-node link and one device's share of its
  node's NICs, ``l_i`` / ``l_x`` their message latencies. Within a node, rings:
  all-reduce ``2 (k-1)/k S / B_i + 2 ceil(log2 k) l_i``, all-gather and reduce-scatter
  half of that, broadcast ``S / B_i + ceil(log2 k) l_i``, p2p ``S / B_i + l_i``. Across
  nodes, hierarchical as NCCL runs them: a stage inside each node and a ring over the
  nodes, pipelined chunk by chunk, so the slower stage paces it: all-reduce
  ``max(2 (k-1)/k S / B_i, 2 (N-1)/N (S/k) / B_x)`` plus both stages' latencies (each
  device's NIC carries 1/k of the data). With 8 H100 per node and 8 NICs of 400 Gb/s
  this gives a bus bandwidth of ~390 GB/s for 2 nodes, against the ~320-380 GB/s
  measured (docs/gpu-facts.md §4); one flat ring at the NIC rate would give ~45.
* all-to-all (expert parallelism's token dispatch and combine) on ``n`` ranks over ``N``
  nodes: each rank sends ``(n-1)/n S`` of its tensor ``S`` (it keeps its own share), of
  which ``(n - k)/(n-1)`` go to the other nodes; the two links run side by side, so
  ``max(intra / A_i, inter / A_x) + l`` with ``A_i`` / ``A_x`` the intra-node link and
  NIC rates at ``all_to_all_intra_efficiency`` / ``all_to_all_inter_efficiency`` (the
  presets': DeepEP's measured dispatch and combine, docs/gpu-terms.md) and ``l`` one
  message latency (``l_x`` across nodes).
* a decode step's attention: its GEMMs, but never faster than reading the KV cache
  (every row's keys and values over the context) at ``kv_read_bytes_per_s``: the
  preset's bandwidth at ``kv_read_bw_efficiency``, which one streaming kernel per layer
  reaches where the weight GEMMs' smaller reads reach ``mem_bw_efficiency``
  (measured on one H100: benchmarks/gpu/README.md, docs/gpu-facts.md §3e).
* engine fixed costs: per layer and micro-batch from the device preset, the work
  besides GEMMs as ``elementwise_passes`` memory passes per token and hidden unit, the
  optimizer as ``optimizer_step_bytes_per_param`` of memory traffic per parameter.
"""
from __future__ import annotations

import math

from planner.cost.cost_config import CostModelConfig
from planner.cost.peer_engines import peer_layer_s
from planner.cost.profile import EngineCosts, ProfileTable, TransferCosts
from planner.specs.cluster import ClusterSpec

#: bytes of the logits per (row, vocabulary column) and the memory passes of a
#: log-softmax over them (read, exponentiate, write)
LOGIT_BYTES, LOGIT_PASSES = 4, 3


def alg_factor(op: str, n: int) -> float:
    """Algorithm bytes per tensor byte (nccl-tests' busbw factors, docs/gpu-facts.md §4)."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


class Rates:
    """Resolved rates of one cluster under one cost configuration and profile."""

    def __init__(self, cluster: ClusterSpec, config: CostModelConfig,
                 profile: ProfileTable | None = None):
        self.cluster, self.config, self.profile = cluster, config, profile
        dev = cluster.device
        self.sources: dict[str, str] = {}
        preset = f"device preset {dev.name}"
        self.dtype_bytes = config.param_dtype_bytes
        self.peak_rate = dev.peak_flops * (config.matmul_efficiency or dev.matmul_efficiency)
        mem = profile.mem_bytes_per_s if profile and profile.mem_bytes_per_s else None
        self.mem_bytes_per_s = mem or dev.mem_bw_bytes_per_s * (
            config.mem_bw_efficiency or dev.mem_bw_efficiency)
        self.sources["memory bandwidth"] = "profile" if mem else preset
        #: bytes/s of a decode step's attention reading the KV cache: a profile's
        #: measured streaming rate, else the preset's bandwidth at kv_read_bw_efficiency
        self.kv_read_bytes_per_s = mem or (
            dev.mem_bw_bytes_per_s * dev.kv_read_bw_efficiency
            if dev.kv_read_bw_efficiency is not None else self.mem_bytes_per_s)
        self.sources["gemm"] = "profile" if profile and profile.gemm else preset
        link = profile.host_link_bytes_per_s if profile else None
        #: host <-> device bytes/s (optimizer and training-state offload)
        self.host_link_bytes_per_s = link or dev.host_link_bytes_per_s
        self.sources["host link"] = "profile" if link else preset
        self.intra_bytes_per_s = dev.intra_node_bytes_per_s * (
            config.link_efficiency or dev.intra_link_efficiency)
        self.inter_bytes_per_s = cluster.inter_node_bytes_per_gpu_s * (
            config.link_efficiency or dev.inter_link_efficiency)
        vllm = ("vllm_prefill", "vllm_decode") if config.generate_engine != "own" else ()
        for kind in ("train", "inference", "prefill", "decode", *vllm):
            self.sources[f"engine {kind}"] = (
                "profile" if profile and kind in profile.engines else preset)
        if self.captured_decode:
            self.sources["engine decode"] += ", captured (no per-layer host cost)"
        if config.train_engine != "own":
            for kind in ("train", "inference"):
                self.sources[f"engine {kind}"] = (
                    f"{preset}, train_engine {config.train_engine} (an eager per-layer host "
                    "cost: planner/cost/peer_engines.py)")
        if vllm and config.vllm_enforce_eager:
            self.sources["engine vllm_decode"] += ", eager (a per-layer host cost)"
        if vllm and config.vllm_scheduler == "sync":
            self.sources["engine vllm_decode"] += ", synchronous scheduler (a host gap per step)"
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p",
                   "all_to_all"):
            for inter in (False, True):
                where = "across nodes" if inter else "within a node"
                got = profile is not None and any(
                    c.op == op and c.inter_node == inter for c in profile.collectives)
                self.sources[f"{op} {where}"] = "profile" if got else preset
        self.sources["reallocation"] = "profile" if profile and profile.realloc else preset
        if vllm:
            self.sources["vllm weight load"] = (
                "profile" if profile and profile.vllm_load else preset)
        self.sources["record send"] = "profile" if profile and profile.send else preset
        self.sources["step overhead"] = "profile" if profile and profile.step else "not priced"

    # ---- compute and memory --------------------------------------------------------
    def gemm_s(self, rows: float, k: float, n: float, train: bool = False) -> float:
        """Seconds of ``[rows, k] x [k, n]`` (forward, or forward + backward): its FLOPs at
        the GEMM rate (a profile's measured grid, else the preset's peak with the width
        curve), but never faster than its bytes (weights once, activations in and out;
        x3 in training) at the memory bandwidth. The grid times each GEMM with its
        weights hot in cache; a model's pass reads every layer's weights once, so a
        small-row GEMM of a model larger than the cache streams them (decode waves)."""
        if rows <= 0 or k <= 0 or n <= 0:
            return 0.0
        flops = (6.0 if train else 2.0) * rows * k * n
        width = math.sqrt(k * n)
        nbytes = (3.0 if train else 1.0) * (k * n + rows * (k + n)) * self.dtype_bytes
        if self.profile is not None and self.profile.gemm is not None:
            rate = self.profile.gemm.rate(rows, width, train)
        else:
            rate = self.peak_rate
            if self.config.gemm_half_width > 0:
                rate *= width / (width + self.config.gemm_half_width)
        return max(flops / rate, nbytes / self.mem_bytes_per_s)

    def mem_s(self, nbytes: float) -> float:
        return nbytes / self.mem_bytes_per_s

    def kv_read_s(self, nbytes: float) -> float:
        """Seconds of a decode step's attention reading ``nbytes`` of KV cache.

        Example: 1e9 bytes on a device of 3.35e12 B/s at kv_read_bw_efficiency 0.8:
        1e9 / 2.68e12 = 0.373 ms."""
        return nbytes / self.kv_read_bytes_per_s

    # ---- collectives ---------------------------------------------------------------
    def collective_s(self, op: str, nbytes: float, n: int, nodes: int = 1) -> float:
        """Seconds of collective ``op`` on a tensor of ``nbytes`` over ``n`` ranks that
        span ``nodes`` nodes (``p2p``: one message between two ranks)."""
        if op != "p2p" and n <= 1:
            return 0.0
        inter = nodes > 1
        if self.profile is not None:
            c = self.profile.collective(op, 2 if op == "p2p" else n, inter)
            if c is not None:
                return c.time_s(nbytes, alg_factor(op, n))
        dev = self.cluster.device
        li, lx = dev.intra_node_latency_s, dev.inter_node_latency_s
        if op == "p2p":
            return nbytes / (self.inter_bytes_per_s if inter else self.intra_bytes_per_s) + (
                lx if inter else li)
        k = max(1, n // max(1, nodes))
        steps = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}[op]
        if op == "broadcast":
            intra = nbytes / self.intra_bytes_per_s if k > 1 else 0.0
            inter_t = nbytes / self.inter_bytes_per_s if inter else 0.0
        else:
            intra = alg_factor(op, k) * nbytes / self.intra_bytes_per_s if k > 1 else 0.0
            inter_t = (alg_factor(op, nodes) * nbytes / k / self.inter_bytes_per_s
                       if inter else 0.0)
        lat = steps * (math.ceil(math.log2(k)) * li if k > 1 else 0.0)
        if inter:
            lat += steps * math.ceil(math.log2(nodes)) * lx
        return max(intra, inter_t) + lat

    def all_to_all_s(self, nbytes: float, n: int, nodes: int = 1) -> float:
        """Seconds of an all-to-all over ``n`` ranks spanning ``nodes`` nodes, each rank
        holding a tensor of ``nbytes`` spread evenly over the ranks (the module
        docstring; a profile's measured ``all_to_all`` curve where it has one).

        Example (8 ranks, one node, 450 GB/s at 0.95, 2.5 us): 8 MB -> 7/8 x 8e6 /
        4.275e11 + 2.5e-6 = 18.9 us."""
        if n <= 1:
            return 0.0
        inter = nodes > 1
        if self.profile is not None:
            c = self.profile.collective("all_to_all", n, inter)
            if c is not None:
                return c.time_s(nbytes, alg_factor("all_to_all", n))
        dev = self.cluster.device
        sent = alg_factor("all_to_all", n) * nbytes
        k = max(1, n // max(1, nodes))
        far = sent * (n - k) / (n - 1)
        intra_rate = dev.intra_node_bytes_per_s * dev.all_to_all_intra_efficiency
        inter_rate = self.cluster.inter_node_bytes_per_gpu_s * dev.all_to_all_inter_efficiency
        wire = max((sent - far) / intra_rate, far / inter_rate if far > 0 else 0.0)
        return wire + (dev.inter_node_latency_s if inter else dev.intra_node_latency_s)

    # ---- realign's engines -----------------------------------------------------------
    def engine(self, kind: str) -> EngineCosts:
        """Fixed costs of the ``train`` | ``inference`` | ``prefill`` | ``decode`` engine,
        or of vLLM's ``vllm_prefill`` | ``vllm_decode`` steps. Without a profile, vLLM's
        decode step on a device that runs kernels asynchronously (GPUs) has no per-layer
        host cost: vLLM replays each decode step as a CUDA graph (its default,
        ``enforce_eager=False``), so launches do not grow with the layers; eager
        (``vllm_enforce_eager``, or a device that runs kernels synchronously) it pays
        the device's per-layer decode cost, as realign's own eager decode step.
        realign's own decode step, captured (:attr:`captured_decode`), has no per-layer
        host cost either, the profile's included (a profile's decode engine times the
        eager step). Scoring and training on another system's engine (``train_engine``
        not ``own``) pay its per-layer host cost (:mod:`planner.cost.peer_engines`),
        whatever a profile measured of realign's."""
        dev, cfg = self.cluster.device, self.config
        peer = peer_layer_s(cfg.train_engine, kind, dev.decode_layer_overhead_s)
        if self.profile is not None and kind in self.profile.engines and peer is None:
            costs = self.profile.engines[kind]
            if kind == "decode" and self.captured_decode:
                return costs.model_copy(update={"layer_s": 0.0})
            return costs
        train = kind == "train"
        mem = self.mem_bytes_per_s
        decode_layer = dev.decode_layer_overhead_s
        if kind == "vllm_decode" and dev.async_kernels and not cfg.vllm_enforce_eager:
            decode_layer = 0.0
        if kind == "decode" and self.captured_decode:
            decode_layer = 0.0
        return EngineCosts(
            call_s=dev.call_overhead_s,
            microbatch_s=dev.microbatch_overhead_s,
            layer_s=(decode_layer if kind in ("decode", "vllm_decode")
                     else peer if peer is not None
                     else (3.0 if train else 1.0) * dev.layer_overhead_s),
            token_hidden_s=(3.0 if train else 1.0) * cfg.elementwise_passes * self.dtype_bytes / mem,
            token_vocab_s=(2.0 if train else 1.0) * LOGIT_PASSES * LOGIT_BYTES / mem,
            token_s=0.0,
            param_s=((cfg.optimizer_step_bytes_per_param + cfg.grad_dtype_bytes) / mem
                     if train else 0.0))

    @property
    def captured_decode(self) -> bool:
        """Whether realign's own decode step is priced as captured and replayed: CUDA
        graphs on a device that runs kernels asynchronously, unless
        ``decode_capture`` is off (``rollout.capture``; on the cpu device the step is
        priced as measured: :class:`~planner.cost.cost_config.CostConfig`)."""
        return self.cluster.device.async_kernels and self.config.decode_capture != "off"

    # ---- transfers -------------------------------------------------------------------
    def send_costs(self) -> TransferCosts:
        """A record sent between meshes (pickled metadata + its tensors, point to point)."""
        if self.profile is not None and self.profile.send is not None:
            return self.profile.send
        dev = self.cluster.device
        return TransferCosts(fixed_s=dev.intra_node_latency_s, per_tensor_s=0.0,
                             bytes_per_s=self.intra_bytes_per_s)

    def send_s(self, nbytes: float, tensors: int) -> float:
        c = self.send_costs()
        return c.fixed_s + c.per_tensor_s * tensors + nbytes / c.bytes_per_s

    def realloc_costs(self) -> TransferCosts | None:
        """Measured reallocation costs (None: link rates and latencies alone)."""
        return self.profile.realloc if self.profile is not None else None
