"""Settings of the engines as torch-free pydantic models, so the experiment schema
(read by ``realign plan`` on a laptop) can embed them without importing torch."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from realign.agents.config import MultiTurn


class Sampling(BaseModel):
    """How the actor samples responses (the experiment's ``sampling`` section; their
    length is the plan's ``gen_len``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, gt=0, description="Divide logits by this before sampling.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 keeps all.")
    top_p: float = Field(1.0, gt=0, le=1.0, description="Keep the smallest set of tokens "
                         "whose probability reaches top_p (nucleus sampling).")


class SamplingParams(Sampling):
    """How one ``generate`` call picks tokens: :class:`Sampling` plus what the call
    itself decides."""

    max_new_tokens: int = Field(16, gt=0, description="Tokens to generate at most per prompt.")
    greedy: bool = Field(False, description="Take the most likely token (ignores the rest).")
    stop_token_ids: tuple[int, ...] = Field((), description="A sequence ends after "
                                            "generating one of these (it is kept).")
    seed: int = Field(0, description="Sampling noise of sequence i's t-th token is a "
                      "hash of (seed, i, t): independent of layout and batch.")


class TrainConfig(BaseModel):
    """Optimiser and step settings of one trainable replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-5, gt=0, description="Adam learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (AdamW); "
                                "megatron skips biases and norms.")
    adam_beta1: float = Field(0.9, gt=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(0.999, gt=0, lt=1, description="Adam beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    clip_grad: float = Field(1.0, ge=0, description="Clip the global grad norm to this; "
                             "0 disables clipping.")
    micro_batches: int | None = Field(
        None, gt=0, description="Micro-batches per optimizer step and DP rank of every train "
        "call. Unset: the plan chooses them; set: the plan must use this many (the search "
        "considers no other count, and a saved or manual plan with another is refused).")
    distributed_optimizer: bool | None = Field(
        None, description="Shard optimizer state over DP (ZeRO-1: reduce-scatter gradients, "
        "all-gather new weights). Unset: on for cuda; off for cpu, where memory is rarely "
        "the limit and one gradient all-reduce is cheaper than gloo's two collectives "
        "(its reduce-scatter cannot be polled, see polled_wait.py).")
    forward: Literal["plain", "megatron", "auto"] = Field(
        "plain", description="The training forward under megatron's schedule, DDP and "
        "optimizer. 'plain' (the default, on CPU and CUDA): the decoder's differentiable "
        "tensor forward over megatron's parameters, the one that generation and scoring "
        "use too, so old, new and reference log-probs come from one implementation (its "
        "equality with megatron's and transformers' forwards is tested). 'megatron' "
        "(opt-in): megatron-core's layers. 'auto': the same as plain.")
    transformer_engine: bool = Field(
        False, description="Opt-in, CUDA only: build the models with Transformer-Engine's "
        "layer spec (fused kernels) instead of megatron's local spec; needs "
        "transformer-engine installed. Its bf16 numerics differ from the plain forward's.")
    packing: bool = Field(
        True, strict=True, description="Scoring (reference, reward, critic, the actor's "
        "log-probs) and training run packed: each micro-batch's rows laid end to end in "
        "one bin of tokens, positions restarting per row and attention confined to each "
        "row, instead of every row padded to the batch's longest (docs/packing.md). The "
        "losses and log-probs are those of the padded step. true (default) or false (the "
        "padded path, for comparison). Needs the plain training forward.")

    @model_validator(mode="after")
    def _packing_forward(self) -> "TrainConfig":
        if self.packing and self.forward == "megatron":
            raise ValueError("train.packing: true needs train.forward plain or auto "
                             "(megatron's local layers take no packed sequences); set "
                             "train.packing: false to train with forward megatron")
        return self

    def uses_distributed_optimizer(self, device: str) -> bool:
        """``distributed_optimizer``, its unset default resolved for ``device``."""
        if self.distributed_optimizer is not None:
            return self.distributed_optimizer
        return device != "cpu"


class VLLMSettings(BaseModel):
    """vLLM's engine settings (``rollout.vllm``): one engine per GPU of a generate call
    that runs on vLLM."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache each engine allocates, "
                                "GiB (on CPU vLLM's VLLM_CPU_KVCACHE_SPACE; on CUDA its "
                                "kv_cache_memory_bytes). It must hold at least one sequence "
                                "of prompt_len + gen_len tokens; it bounds how many decode "
                                "at once.")
    max_num_seqs: int = Field(256, gt=0, description="The most sequences one engine decodes "
                              "at once (vLLM's max_num_seqs).")


class Rollout(MultiTurn):
    """Which engine generates (the experiment's ``rollout`` section), how the rollout's
    log-probs are compared with training's, and the multi-turn keys (environments and
    tools: :class:`~realign.agents.config.MultiTurn`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["own", "vllm", "auto"] = Field(
        "own", description="The engine of every generate call (rollout, ReMax's greedy "
        "baseline, evaluations): 'own' (realign's decoder: rollout.refill), 'vllm' (vLLM: "
        "continuous batching, one engine per GPU; needs `make vllm-env`, docs/vllm.md) or "
        "'auto' (the planner prices both for each call and picks; the plan says which).")
    refill: bool = Field(
        True, strict=True, description="realign's own engine: a sequence that has ended gives its "
        "KV-cache slot to the next waiting prompt, instead of each wave of the plan "
        "waiting for its longest (docs/packing.md); the planner prices its expected "
        "decode steps. false: static waves, for comparison.")
    capture: Literal["auto", "on", "off"] = Field(
        "auto", description="realign's own engine: each decode step shape captured once and "
        "replayed, so the host does not issue every layer's kernels every step "
        "(docs/gpu.md): 'auto' captures on CUDA (CUDA graphs) and keeps the CPU eager, "
        "'on' also compiles the CPU's steps (torch.compile: about a minute per shape, "
        "a few per cent faster on the bench model: benchmarks/generate/README.md), 'off' "
        "runs eager everywhere. Outputs equal the eager steps'; the planner prices a "
        "captured GPU step without a per-layer host cost.")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings)
    mode: Literal["step", "streaming"] = Field(
        "step", description="How generation meets training: 'step' (each step generates "
        "its rollout, or the next step's one step ahead with algorithm.max_staleness >= 1) "
        "or 'streaming' (a generator decoding continuously on its own GPUs into a rollout "
        "buffer, samples up to algorithm.max_staleness versions old; docs/async.md says "
        "what it runs and refuses).")
    on_update: Literal["continue", "finish"] = Field(
        "continue", description="rollout.mode streaming: when new weights reach the "
        "generator, the sequences in flight 'continue' under them (each token keeps the "
        "version and behaviour log-prob it was generated with) or 'finish' under the "
        "weights they began with before the update applies.")
    logprob_diff_threshold: float = Field(
        0.01, gt=0, description="The train call logs the share of response tokens whose "
        "rollout log-prob differs from the training forward's by more than this (nats): "
        "actor.rollout_logprob_diff_frac, beside its mean and max.")
    routing_replay: Literal["auto", "on", "off"] = Field(
        "auto", description="Rollout routing replay (R3) of a mixture-of-experts actor "
        "generating on vLLM: the experts vLLM routed each token to (prompt and response) "
        "are forced in the actor's scoring (actor.prox_inference) and train calls, so the "
        "trained policy's tokens go through the experts that sampled them (the reference "
        "keeps its own routing; docs/vllm.md). 'auto': wherever vLLM records its routing "
        "(it runs eagerly: device cpu), elsewhere nothing is replayed "
        "(no actor.moe.replayed_frac logged); 'on': the same, and a run that cannot replay (a "
        "dense actor, the own engine, vLLM on CUDA, a multi-turn rollout) exits 2 before "
        "it starts; 'off': each forward routes with its own router.")

    def scores_rollout(self) -> bool:
        """Whether the actor's training forward scores the rollout before its update
        (``actor.prox_inference``): with vLLM possible, its log-probs come from another
        implementation, so their difference is measured every step."""
        return self.engine != "own"
