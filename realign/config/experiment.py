"""The experiment YAML schema (the part the planner reads; ``realign run`` extends it).

Every section is a pydantic model with unknown keys forbidden; defaults live here,
once. A model is named by a preset (``llama2-7b``, ``qwen2.5-0.5b``, ``tiny-llama``...)
or by a path to a Hugging Face ``config.json`` or checkpoint folder (relative paths
are resolved against the YAML file's folder).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from planner.algorithms import Algorithm, BatchShape
from planner.cluster import ClusterSpec, DeviceSpec, resolve_device
from planner.cost_config import CostModelConfig
from planner.search import SearchSettings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelsConfig(_Strict):
    """Models by role: a preset name or a path to a HF config.json / checkpoint folder."""

    actor: str | None = Field(None, description="Policy being trained (LM head).")
    critic: str | None = Field(None, description="Value model (PPO), trained (value head).")
    ref: str | None = Field(None, description="Frozen reference policy for the KL term (LM head).")
    reward: str | None = Field(None, description="Reward model (value head); trained under `rm`.")

    def roles(self) -> dict[str, str]:
        return {r: v for r, v in self.model_dump().items() if v is not None}


class AlgorithmConfig(BatchShape):
    """The algorithm and the shape of one step's batch."""

    name: Algorithm = Field(description="ppo | grpo | remax | reinforce_pp | rloo | dpo | sft | rm")

    def shape(self) -> BatchShape:
        return BatchShape(**self.model_dump(exclude={"name"}))


class ClusterConfig(_Strict):
    """Nodes x devices per node, and the device kind (a preset name or explicit numbers)."""

    nodes: int = Field(1, gt=0, description="Number of nodes.")
    gpus_per_node: int = Field(8, gt=0, description="Devices per node.")
    device: str | DeviceSpec = Field(
        "h100-80g", description="a100-80g | h100-80g | h200 | cpu, or a mapping of DeviceSpec fields.")

    def spec(self) -> ClusterSpec:
        dev = resolve_device(self.device) if isinstance(self.device, str) else self.device
        return ClusterSpec(n_nodes=self.nodes, gpus_per_node=self.gpus_per_node, device=dev)


class PlanConfig(SearchSettings):
    """How the plan is found (search settings), priced (cost model) and measured."""

    cost: CostModelConfig = Field(default_factory=CostModelConfig,
                                  description="Analytic cost model settings.")
    profile: str | None = Field(None, description="Path to a measured profile table (JSON).")


class ExperimentConfig(_Strict):
    """One experiment: models, algorithm, cluster and planning settings."""

    name: str = Field(description="Experiment name (used in plans and run folders).")
    models: ModelsConfig
    algorithm: AlgorithmConfig
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
