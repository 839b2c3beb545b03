"""The experiment YAML schema (the part the planner reads; ``realign run`` extends it).

Every section is a pydantic model with unknown keys forbidden; defaults live here,
once. A model is named by a preset (``llama2-7b``, ``qwen2.5-0.5b``, ``tiny-llama``...)
or by a path to a Hugging Face ``config.json`` or checkpoint folder. Every field that
names a file has a type of :mod:`realign.paths`: a relative path is resolved against the
YAML file's folder while the YAML is validated, so a loaded config holds absolute paths.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from planner.cost.cost_config import CostModelConfig
from planner.graph.algorithms import Algorithm, BatchShape, algorithm_spec
from planner.graph.dataflow import MAX_STALENESS
from planner.search_settings import SearchSettings
from planner.specs.cluster import MAX_GPUS_PER_NODE, MAX_NODES, ClusterSpec, DeviceSpec, resolve_device
from planner.specs.layout import Allocation
from planner.specs.lora import LoraSpec
from realign.algorithms.params import AlgorithmParams
from realign.algorithms.params_table import AnyParams, make_params
from realign.config.streaming import check_streaming
from realign.data.config import DatasetConfig
from realign.paths import CodeRef, FilePath, ModelRef
from realign.runtime.settings import Rollout, Sampling, TrainConfig

#: The most steps a run takes (``run.steps`` and ``--steps`` alike).
MAX_STEPS = 10 ** 9


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelsConfig(_Strict):
    """Models by role: a preset name or a path to a HF config.json / checkpoint folder."""

    actor: ModelRef | None = Field(None, description="Policy being trained (LM head).")
    critic: ModelRef | None = Field(None, description="Value model (PPO), trained (value head).")
    ref: ModelRef | None = Field(None, description="Frozen reference policy for the KL term (LM head).")
    reward: ModelRef | None = Field(None, description="Reward model (value head); trained under `rm`.")

    def roles(self) -> dict[str, str]:
        return {r: v for r, v in self.model_dump().items() if v is not None}


class LoraConfig(LoraSpec):
    """LoRA on one trained role (``lora.<role>``): the planner's settings (rank, alpha,
    dropout, target_modules) and where the adapters come from and go to."""

    init_from: FilePath | None = Field(
        None, description="A PEFT adapter folder (adapter_config.json + "
        "adapter_model.safetensors) to start from, made for this role's base model "
        "(relative to the YAML file). Unset: A random (Kaiming-uniform, as PEFT), B zero.")
    merged: bool = Field(False, description="Also write the final model with the adapters "
                         "merged into the base weights (a full Hugging Face checkpoint).")
    share_base: bool = Field(
        True, description="Score a frozen role that is this role's base with this model's "
        "adapters off instead of loading it a second time: models.ref when it is the "
        "actor's checkpoint (lora.actor), models.reward when it is the critic's (lora.critic; "
        "the reward's head is kept beside the critic's trained one). false: load it "
        "separately (docs/lora.md).")

    def spec(self) -> LoraSpec:
        """The planner's part."""
        return LoraSpec(**self.model_dump(include=set(LoraSpec.model_fields)))


class AlgorithmSection(BatchShape):
    """The algorithm, the shape of one step's batch, and its hyper-parameters."""

    name: Algorithm = Field(description="ppo | grpo | remax | reinforce_pp | rloo | dpo | sft | "
                            "rm | rejection_sampling | online_dpo | dapo | gspo | dr_grpo")
    params: AnyParams = Field(
        default_factory=dict, validate_default=True,
        description="Hyper-parameters of the algorithm (e.g. kl_coef, clip_ratio), typed by "
                    "name when the YAML is loaded: the keys of its algorithm.params section "
                    "below. Batch-shape fields are set above, not here.")
    max_staleness: int = Field(
        0, ge=0, le=MAX_STALENESS, description="Asynchronous (off-policy) execution: the "
        "most policy versions a trained sample may lag. 0: synchronous. With 1 or more the "
        "planner also prices generation one step ahead of training on its own GPUs, and "
        "runs whichever plan is faster.")

    @field_validator("params", mode="before")
    @classmethod
    def _typed_params(cls, raw: Any, info: ValidationInfo) -> AlgorithmParams:
        """``algorithm.params`` as the typed hyper-parameters of ``name``, with the
        fields the batch shape sets (:func:`~realign.algorithms.params_table.make_params`: a
        :class:`UserError` naming ``algorithm.params.<key>``). A typed value (a config
        built in code, or copied) is typed again from the keys it was written with."""
        if isinstance(raw, AlgorithmParams):
            raw = raw.written()
        if not isinstance(raw, Mapping):
            raise ValueError("a mapping of hyper-parameter names to values")
        unset = [k for k in ("name", *BatchShape.model_fields) if k not in info.data]
        if unset:
            raise ValueError(f"typed by algorithm.{unset[0]}, which is not valid")
        shape = BatchShape(**{k: info.data[k] for k in BatchShape.model_fields})
        return make_params(info.data["name"], raw, shape)

    @field_serializer("params")
    def _written_params(self, params: AlgorithmParams) -> dict[str, Any]:
        """Saved as the keys the experiment wrote, so that it loads back the same."""
        return params.written()

    def shape(self) -> BatchShape:
        return BatchShape(**self.model_dump(exclude={"name", "params", "max_staleness"}))


class ClusterConfig(_Strict):
    """Nodes x devices per node, and the device kind (a preset name or explicit numbers)."""

    nodes: int = Field(1, gt=0, le=MAX_NODES, description=f"Number of nodes (at most "
                       f"{MAX_NODES}: the planner's space grows with its square).")
    gpus_per_node: int = Field(8, gt=0, le=MAX_GPUS_PER_NODE, description="Devices per node.")
    device: str | DeviceSpec = Field(
        "h100-80g", description="a100-80g | h100-80g | h200 | cpu, or a mapping of DeviceSpec fields.")
    nics_per_node: int | None = Field(
        None, gt=0, description="Network interfaces per node; default one per device "
        "(DGX-class nodes).")

    def spec(self) -> ClusterSpec:
        dev = resolve_device(self.device) if isinstance(self.device, str) else self.device
        return ClusterSpec(n_nodes=self.nodes, gpus_per_node=self.gpus_per_node, device=dev,
                           nics_per_node=self.nics_per_node)


class PlanConfig(SearchSettings):
    """How the plan is found (search settings), priced (cost model) and measured."""

    cost: CostModelConfig = Field(default_factory=CostModelConfig,
                                  description="Analytic cost model settings.")
    profile: FilePath | None = Field(None, description="Path to a measured profile table (JSON).")
    lengths_from: FilePath | None = Field(
        None, description="A previous run's folder (or its metrics.jsonl): price generation "
        "with the response lengths it recorded (every sampled response's length, from its "
        "response_len_hist; from an older run, the mean of its response_len, as "
        "algorithm.gen_len_mean prices a mean) instead of algorithm.gen_len_mean.")
    file: FilePath | None = Field(None, description="realign run: execute this saved plan.json "
                                               "instead of searching.")
    manual: dict[str, Allocation] | None = Field(
        None, description="realign run: an allocation per MFC (by name) instead of searching.")


class DataConfig(_Strict):
    """Datasets of ``realign run``."""

    train: DatasetConfig = Field(description="The training data (JSONL).")


class EvalConfig(_Strict):
    """Evaluation of the actor on held-out prompts during training: its greedy answer
    and ``samples`` sampled answers per prompt, scored for the metrics ``eval.*``."""

    data: DatasetConfig = Field(description="The held-out prompts (kind prompts, with "
                                "answers); none may be a training prompt.")
    interval: int = Field(10, gt=0, description="Evaluate after every this many steps (and "
                          "after the first and the last step).")
    samples: int = Field(4, gt=0, le=1024, description="Sampled answers per prompt: the "
                         "sampled reward and accuracy, and pass@k with k = samples.")
    max_prompts: int | None = Field(None, gt=0, description="Use the first this many "
                                    "prompts of the file (null: all).")
    verifier: CodeRef = Field("math_verify", description="What counts as correct (accuracy, "
                          "pass@k): a built-in or 'module:function'(prompt, response, answer) "
                          "returning true/false or 1/0.")


class RewardConfig(_Strict):
    """Where rewards come from when there is no reward model."""

    fn: CodeRef = Field("math_verify", description="A built-in (math_verify) or a user's "
                                               "'module:function'(prompt, response, answer) -> float.")


class RunConfig(_Strict):
    """The run folder, length, checkpoints and seed of ``realign run``."""

    dir: str = Field("runs/{name}", description="Run folder ({name}: the experiment name); "
                                               "relative to the current directory.")
    steps: int = Field(20, gt=0, le=MAX_STEPS, description=f"Training steps (at most "
                       f"{MAX_STEPS:.0e}).")
    checkpoint_interval: int = Field(5, gt=0, description="Steps between checkpoints.")
    seed: int = Field(0, ge=0, description="Seed of initialisation and sampling.")
    call_timeout_s: float | None = Field(
        None, gt=0, description="How long one call (or reallocation, transfer, reward) may "
        "run once all its ranks have reached it before the controller fails the run, naming "
        "the call and the ranks that did not arrive at its collectives. Unset: per call, 10x "
        "the plan's estimate of it, at least 600 s.")
    collective_timeout_s: float | None = Field(
        None, gt=0, description="The process groups' own timeout (gloo/NCCL): how long a "
        "worker waits in one collective before it fails by itself, a backstop behind "
        "call_timeout_s. Unset: 10x a step's estimated duration if every call ran in turn, "
        "at least 600 s, and at least the longest call timeout plus 60 s.")


class LocalLauncherConfig(_Strict):
    """Worker processes on this machine."""

    type: Literal["local"] = "local"
    threads_per_worker: int = Field(1, gt=0, description="CPU threads per worker process.")


class SlurmLauncherConfig(_Strict):
    """A Slurm batch job: ``srun`` starts one worker per device and the controller."""

    type: Literal["slurm"]
    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    time_limit: str = Field("01:00:00", description="sbatch --time (HH:MM:SS or D-HH:MM:SS).")
    nodes: int | None = Field(None, gt=0, description="Nodes; default: the plan's cluster.")
    gpus_per_node: int | None = Field(None, gt=0, description="Devices (tasks) per node; "
                                      "default: the plan's cluster.")
    cpus_per_task: int = Field(1, gt=0, description="sbatch --cpus-per-task.")
    sbatch_flags: list[str] = Field(default_factory=list, description="Extra sbatch flags, verbatim.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment of the job.")
    container_image: str | None = Field(None, description="Pyxis --container-image for srun.")
    threads_per_worker: int = Field(1, gt=0, description="CPU threads per worker process.")
    gpus: Literal["per_node", "per_task"] = Field(
        "per_node", description="device cuda: how the job asks for GPUs. per_node: "
        "--gpus-per-node=<tasks per node> (every task sees the node's GPUs; a worker uses "
        "the one of its local rank); per_task: --gpus-per-task=1 (each task sees only its "
        "own GPU).")


class RayLauncherConfig(_Strict):
    """A Ray job: the controller is the job's driver, workers are Ray actors."""

    type: Literal["ray"]
    address: str = Field("auto", description="Ray cluster: auto, or an address such as "
                                            "http://127.0.0.1:8265 (job API) / host:port.")
    runtime_env: dict[str, Any] = Field(default_factory=dict, description="Ray runtime_env.")
    resources_per_worker: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Resources of each worker actor (one bundle per device).")
    threads_per_worker: int = Field(1, gt=0, description="CPU threads per worker process.")


LauncherConfig = Annotated[LocalLauncherConfig | SlurmLauncherConfig | RayLauncherConfig,
                           Field(discriminator="type")]


class ExperimentConfig(_Strict):
    """One experiment: models, algorithm, cluster and planning settings."""

    name: str = Field(description="Experiment name (used in plans and run folders).")
    models: ModelsConfig
    lora: dict[Literal["actor", "critic", "reward"], LoraConfig] = Field(
        default_factory=dict, description="LoRA per trained role (actor, critic, reward): "
        "its base weights frozen, only the adapters trained, checkpointed and moved between "
        "placements.")
    algorithm: AlgorithmSection
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    # ---- realign run (ignored by realign plan) ----
    device: Literal["cpu", "cuda"] = Field("cuda", description="cpu (gloo) or cuda (NCCL).")
    dtype: Literal["bf16", "fp32"] | None = Field(
        None, description="Parameter dtype of every model: bf16 (megatron's mixed-precision "
        "optimizers keep fp32 main weights) or fp32. Unset: bf16 on cuda, fp32 on cpu.")
    data: DataConfig | None = Field(None, description="Datasets (required by realign run).")
    reward: RewardConfig | None = Field(None, description="Rule reward when no reward model is set.")
    eval: EvalConfig | None = Field(None, description="Evaluation on held-out prompts during "
                                    "training (metrics eval.*).")
    train: TrainConfig = Field(default_factory=TrainConfig,
                               description="Optimizer settings (and a fixed micro-batch count).")
    sampling: Sampling = Field(default_factory=Sampling)
    rollout: Rollout = Field(default_factory=Rollout, description="The engine that "
                             "generates (own | vllm | auto) and vLLM's settings.")
    run: RunConfig = Field(default_factory=RunConfig)
    launcher: LauncherConfig = Field(default_factory=LocalLauncherConfig,
                                     description="local | slurm | ray, with their options.")

    @model_validator(mode="after")
    def _streaming_supported(self) -> "ExperimentConfig":
        """``rollout.mode: streaming`` refused, naming the field at fault
        (:func:`~realign.config.streaming.check_streaming`)."""
        check_streaming(self)
        return self

    def run_dtype(self) -> str:
        """``dtype``, its unset default resolved for ``device``."""
        return self.dtype or ("bf16" if self.device == "cuda" else "fp32")

    def tokenizer_role(self) -> str:
        """The model role whose folder holds the tokenizer: the actor's, or the reward
        model's when there is no actor (reward modelling)."""
        return "actor" if self.models.actor is not None else "reward"

    def rule_reward_fn(self) -> str | None:
        """The reward function that scores generated text (``reward.fn``, or its default)
        when the algorithm generates and no reward model scores; None otherwise."""
        if not algorithm_spec(self.algorithm.name).generates or self.models.reward is not None:
            return None
        return (self.reward or RewardConfig()).fn
