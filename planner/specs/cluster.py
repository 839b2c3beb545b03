"""ClusterSpec: nodes x GPUs per node, and one device type's rates and sizes.

Every hardware number lives here, with its unit in its name; no logic elsewhere
hard-codes a memory size or a node width. Presets are in
``planner/presets/devices.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import PlanError

#: Largest cluster the planner takes: its candidate space (and memory) grows with the
#: square of the node count (runs of whole nodes); 256 nodes take ~1 GB and ~10 s to
#: set up on one core.
MAX_NODES = 256
#: Most devices per node (one NVLink domain; an NVL72 rack has 72) the planner takes.
MAX_GPUS_PER_NODE = 512


class DeviceSpec(BaseModel):
    """Rates and sizes of one accelerator and its links (dense bf16 unless noted)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Device preset name or a user label.")
    peak_flops: float = Field(gt=0, description="Peak dense bf16 FLOP/s of one device.")
    mem_bytes: float = Field(gt=0, description="Device memory in bytes.")
    mem_bw_bytes_per_s: float = Field(gt=0, description="Device memory bandwidth, bytes/s.")
    intra_node_bytes_per_s: float = Field(
        gt=0, description="Per-device one-direction bandwidth inside a node (NVLink), bytes/s.")
    inter_node_bytes_per_s: float = Field(
        gt=0, description="Per-device one-direction bandwidth across nodes (NIC), bytes/s.")
    intra_node_latency_s: float = Field(5e-6, ge=0, description="Latency of one intra-node message.")
    inter_node_latency_s: float = Field(1e-5, ge=0, description="Latency of one inter-node message.")
    layer_overhead_s: float = Field(
        0.0, ge=0, description="Fixed cost of running one layer on one micro-batch once "
        "(kernel launches, framework work), paid per forward or backward pass.")
    microbatch_overhead_s: float = Field(
        0.0, ge=0, description="Fixed cost per micro-batch of a pipelined pass "
        "(schedule, loss, logits bookkeeping).")
    decode_layer_overhead_s: float = Field(
        0.0, ge=0, description="Fixed cost of one layer in one decode step of realign's "
        "eager decode loop (no CUDA graphs: the host launching kernels paces it).")
    call_overhead_s: float = Field(0.0, ge=0, description="Fixed cost of one engine call.")
    async_kernels: bool = Field(
        False, description="The host queues kernels on the device and runs ahead of it "
        "(CUDA streams): a pass costs the longer of the host's fixed costs and the "
        "device's work, not their sum. False (the cpu device): the same cores do both.")
    matmul_efficiency: float = Field(
        0.5, gt=0, le=1, description="Fraction of peak FLOP/s that large GEMMs reach.")
    mem_bw_efficiency: float = Field(
        0.8, gt=0, le=1, description="Fraction of the memory bandwidth that streaming reaches.")
    kv_read_bw_efficiency: float | None = Field(
        None, gt=0, le=1, description="Fraction of the memory bandwidth a decode step's "
        "attention reaches reading the KV cache (one kernel per layer streaming every row's "
        "keys and values, against the weight GEMMs' many smaller reads); None: "
        "mem_bw_efficiency.")
    intra_link_efficiency: float = Field(
        0.8, gt=0, le=1, description="Fraction of the intra-node link rate collectives reach.")
    inter_link_efficiency: float = Field(
        0.8, gt=0, le=1, description="Fraction of the NIC rate collectives reach.")
    all_to_all_intra_efficiency: float = Field(
        0.8, gt=0, le=1, description="Fraction of the intra-node link rate an all-to-all "
        "reaches per rank (expert parallelism's token dispatch and combine).")
    all_to_all_inter_efficiency: float = Field(
        0.8, gt=0, le=1, description="Fraction of the NIC rate an all-to-all reaches per "
        "rank across nodes (expert parallelism's token dispatch and combine).")
    host_link_bytes_per_s: float = Field(
        25e9, gt=0, description="Device <-> host memory bandwidth per device (PCIe), bytes/s: "
        "what optimizer offload pays.")
    host_mem_bytes: float = Field(
        128 * 2 ** 30, gt=0, description="Host memory per device, bytes (a node's memory over "
        "its devices): what offloaded optimizer state may use.")
    host_adam_params_per_s: float | None = Field(
        None, gt=0, description="Parameters per second one device's share of its host "
        "steps with Adam on the CPU (optimizer offload); None: the planner offers no "
        "optimizer offload on this device (e.g. the cpu device, whose state is on the host "
        "already).")
    sources: dict[str, str] = Field(
        default_factory=dict, description="Where each number comes from (field -> citation).")


class ClusterSpec(BaseModel):
    """A homogeneous cluster: ``n_nodes`` nodes of ``gpus_per_node`` devices."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_nodes: int = Field(gt=0, le=MAX_NODES, description="Number of nodes.")
    gpus_per_node: int = Field(gt=0, le=MAX_GPUS_PER_NODE, description="Devices per node.")
    device: DeviceSpec = Field(description="The device type of every node.")
    nics_per_node: int | None = Field(
        None, gt=0, description="Network interfaces per node (each at the device's "
        "inter_node_bytes_per_s); None: one per device, as on DGX-class nodes.")

    @property
    def inter_node_bytes_per_gpu_s(self) -> float:
        """One device's share of its node's network bandwidth (one direction)."""
        nics = self.nics_per_node if self.nics_per_node is not None else self.gpus_per_node
        return self.device.inter_node_bytes_per_s * min(1.0, nics / self.gpus_per_node)

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        """Node index of a global GPU index (GPUs are numbered node by node)."""
        return gpu // self.gpus_per_node

    def describe(self) -> str:
        return f"{self.n_nodes}x{self.gpus_per_node} {self.device.name}"


def device_presets() -> dict[str, DeviceSpec]:
    raw = json.loads((Path(__file__).parents[1] / "presets" / "devices.json").read_text())
    return {name: DeviceSpec(name=name, **fields) for name, fields in raw.items()}


def resolve_device(name: str) -> DeviceSpec:
    presets = device_presets()
    if name not in presets:
        raise PlanError(f"unknown device {name!r}; allowed: {', '.join(sorted(presets))} "
                        "(or give explicit numbers)", field="cluster.device")
    return presets[name]
