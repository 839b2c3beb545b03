"""DeviceMesh: a rectangular block of the cluster that one MFC runs on.

A mesh is either a power-of-two slice of one node, aligned to its size (GPUs 0-3 or
4-5 of a node, not 1-2), or a run of whole consecutive nodes. GPUs are numbered
node by node: global GPU ``g`` lives on node ``g // gpus_per_node``. Meshes of
different MFCs may be disjoint, nested or equal.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import PlanError
from planner.specs.cluster import ClusterSpec


class DeviceMesh(BaseModel):
    """GPUs ``first_gpu .. first_gpu + n_gpus - 1`` of the cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    first_gpu: int = Field(ge=0, description="Global index of the mesh's first GPU.")
    n_gpus: int = Field(gt=0, description="Number of GPUs in the mesh.")

    @property
    def gpus(self) -> range:
        return range(self.first_gpu, self.first_gpu + self.n_gpus)

    def name(self, gpus_per_node: int) -> str:
        """``n2:g4-7`` (part of node 2) or ``n0-3`` (nodes 0 to 3)."""
        node, off = divmod(self.first_gpu, gpus_per_node)
        if self.n_gpus < gpus_per_node or gpus_per_node == 1 and self.n_gpus == 1:
            last = off + self.n_gpus - 1
            return f"n{node}:g{off}" if last == off else f"n{node}:g{off}-{last}"
        last_node = node + self.n_gpus // gpus_per_node - 1
        return f"n{node}" if last_node == node else f"n{node}-{last_node}"

    def overlaps(self, other: "DeviceMesh") -> bool:
        return (self.first_gpu < other.first_gpu + other.n_gpus
                and other.first_gpu < self.first_gpu + self.n_gpus)

    def validate_on(self, cluster: ClusterSpec, field: str = "mesh") -> None:
        """Raise :class:`PlanError` unless this is a valid mesh of ``cluster``."""
        gpn = cluster.gpus_per_node
        if self.first_gpu + self.n_gpus > cluster.n_gpus:
            raise PlanError(f"mesh GPUs {self.first_gpu}..{self.first_gpu + self.n_gpus - 1} "
                            f"exceed the cluster's {cluster.n_gpus} GPUs", field=field)
        if self.n_gpus >= gpn:
            if self.n_gpus % gpn or self.first_gpu % gpn:
                raise PlanError(f"a mesh of {self.n_gpus} GPUs must be whole nodes of {gpn} "
                                "starting at a node boundary", field=field)
        else:
            # The size must also divide the node, else an aligned block can straddle
            # two nodes (4 GPUs at 4 on nodes of 6).
            if (self.n_gpus & (self.n_gpus - 1) or gpn % self.n_gpus
                    or self.first_gpu % self.n_gpus):
                raise PlanError(f"a mesh inside one node must have a power-of-two size "
                                f"that divides the node's {gpn} GPUs, aligned to it (got "
                                f"{self.n_gpus} GPUs at {self.first_gpu})", field=field)


def enumerate_meshes(cluster: ClusterSpec) -> list[DeviceMesh]:
    """Every valid mesh of ``cluster``, smallest first.

    Example: 2 nodes x 4 GPUs -> sizes 1 (8 meshes), 2 (4), 4 (whole nodes, 2), 8 (1):
    15 meshes.
    """
    gpn, out = cluster.gpus_per_node, []
    size = 1
    while size < gpn:
        if gpn % size == 0:
            for node in range(cluster.n_nodes):
                for off in range(0, gpn - size + 1, size):
                    out.append(DeviceMesh(first_gpu=node * gpn + off, n_gpus=size))
        size *= 2
    for n_nodes in range(1, cluster.n_nodes + 1):
        for start in range(cluster.n_nodes - n_nodes + 1):
            out.append(DeviceMesh(first_gpu=start * gpn, n_gpus=n_nodes * gpn))
    return out
