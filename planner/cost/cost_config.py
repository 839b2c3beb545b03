"""Settings of the analytic cost model (every default documented, units in names)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.cost.peer_engines import TrainEngine

#: Which engine a generate call runs on: realign's own (waves) or vLLM (continuous
#: batching); ``auto``: the search prices both per call and picks.
GenerateEngine = Literal["own", "vllm", "auto"]

#: Generation's KV cache holds whole blocks of this many positions (realign's decoder
#: attends over whole 16-key blocks, see ``realign/runtime/engines/decoder.py``;
#: vLLM's paged cache also defaults to 16-token blocks).
KV_CACHE_BLOCK_TOKENS = 16


class CostModelConfig(BaseModel):
    """Efficiencies and training precision the analytic cost model assumes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    matmul_efficiency: float | None = Field(
        None, gt=0, le=1, description="Fraction of peak FLOP/s that large GEMMs reach; "
        "None: the device preset's (cited there).")
    gemm_half_width: float = Field(
        128.0, ge=0, description="GEMM width (sqrt of the weight's rows x columns per GPU) at "
        "which a GEMM reaches half of matmul_efficiency (SMs left idle by few output tiles); "
        "0 ignores the width.")
    mem_bw_efficiency: float | None = Field(
        None, gt=0, le=1, description="Fraction of peak memory bandwidth that streaming "
        "reaches; None: the device preset's.")
    link_efficiency: float | None = Field(
        None, gt=0, le=1, description="Fraction of link bandwidth (intra- and inter-node) that "
        "collectives and copies reach; None: the device preset's.")
    elementwise_passes: float = Field(
        20.0, ge=0, description="Element reads and writes per token, hidden unit and layer "
        "of a forward besides the GEMMs (two norms, RoPE, gated activation, residuals), "
        "priced at the memory bandwidth when no profile measured them (x3 in training).")
    param_dtype_bytes: int = Field(2, gt=0, description="Bytes per weight in compute (bf16: 2).")
    grad_dtype_bytes: int = Field(4, gt=0, description="Bytes per main gradient (megatron keeps fp32: 4).")
    optimizer_state_bytes_per_param: int = Field(
        12, gt=0, description="fp32 master weight + Adam m + v: 12 bytes per parameter.")
    optimizer_step_bytes_per_param: int = Field(
        30, gt=0, description="Memory traffic of one Adam step per parameter (reads and writes).")
    distributed_optimizer: bool = Field(
        True, description="Shard optimizer state over the data-parallel ranks (ZeRO-1).")
    optimizer_offload: Literal["never", "auto", "always"] = Field(
        "auto", description="Optimizer state (fp32 main weights' host copy, Adam m and v) "
        "in host memory, stepped by the CPU: 'auto' lets the search choose it per trained "
        "model where it pays (it frees GPU memory and costs the gradient and weight "
        "transfers and the host's Adam step); 'never'; 'always' (where the device offers "
        "it: its host_adam_params_per_s is set). The runtime executes it with "
        "megatron-core's HybridDeviceOptimizer (CUDA, distributed optimizer).")
    train_state_offload: Literal["never", "auto", "always"] = Field(
        "auto", description="Between its train calls a trained model keeps only its "
        "weights on the GPU: its gradients are freed and the optimizer state the GPU "
        "holds (fp32 main weights, and Adam m and v unless optimizer_offload keeps them on "
        "the host) waits in host memory, so other calls get that memory; each train call "
        "pays the state's transfer up and down. 'auto' lets the search choose it per "
        "trained model (where the device has memory of its own: its "
        "host_adam_params_per_s is set); 'never'; 'always' (any device, cpu included).")
    recompute: Literal["never", "auto", "always"] = Field(
        "auto", description="Full activation recomputation in a train call (each layer "
        "keeps only its input and runs its forward again in the backward: one more "
        "forward of the layers, far less activation memory). 'auto' lets the search "
        "choose it per train call; 'never'; 'always'.")
    mem_usable_fraction: float = Field(
        0.9, gt=0, le=1, description="Part of device memory a plan may use (rest: context, fragmentation).")
    kv_cache_block_tokens: int = Field(
        KV_CACHE_BLOCK_TOKENS, gt=0, description="Positions per KV-cache block: a generated "
        "sequence's cache is allocated for prompt_len + gen_len rounded up to whole blocks.")
    generate_engine: GenerateEngine = Field(
        "own", description="The engine of every generate call: 'own' (realign's decoder, in "
        "waves), 'vllm' (vLLM, continuous batching, one engine per GPU: TP 1, PP 1) or "
        "'auto' (the search prices both for each call and keeps the faster plan). Set from "
        "the experiment's rollout.engine.")
    decode_capture: Literal["auto", "on", "off"] = Field(
        "auto", description="realign's own engine: its decode steps captured once per shape "
        "and replayed (CUDA graphs; rollout.capture). On a device that runs kernels "
        "asynchronously (the GPU presets) a captured step's host cost is per step, not per "
        "layer: no decode_layer_overhead_s ('auto' and 'on'). Elsewhere (the cpu device) "
        "the step is priced as measured, eager ('auto' keeps the CPU eager; 'on' compiles "
        "it, measured within a few per cent of eager: benchmarks/generate/README.md). "
        "Set from the experiment's rollout.capture.")
    vllm_enforce_eager: bool = Field(
        False, description="vLLM decodes eagerly (its enforce_eager: no CUDA graphs), so "
        "each decode step pays the device's decode_layer_overhead_s per layer, as an "
        "eager loop does. realign runs vLLM with CUDA graphs on GPUs (False); True prices "
        "a run of another system that did not (verl's rollout.enforce_eager defaults to "
        "True in its ppo_trainer.yaml: docs/gpu-facts.md §3e).")
    vllm_scheduler: Literal["async", "sync"] = Field(
        "async", description="vLLM's host work between decode steps (scheduling, the next "
        "step's inputs, the sampled tokens' copy to the host and their output "
        "processing): 'async' overlaps it with the device (vLLM V1, the engine realign "
        "runs), leaving VLLM_ASYNC_STEP_GAP_S of device idle per decode step with CUDA "
        "graphs (docs/gpu-terms.md); 'sync' makes the device wait for it on every decode step, "
        "VLLM_SYNC_STEP_S seconds (vLLM v0 without multi-step scheduling: "
        "docs/gpu-facts.md §3e); for pricing runs of other systems on v0.")
    train_engine: TrainEngine = Field(
        "own", description="The engine of every scoring and training call: 'own' "
        "(realign's Megatron passes, the device preset's layer_overhead_s); 'hf' (Hugging "
        "Face layers run eagerly, weights whole on each rank: DeepSpeed ZeRO-1/2, DDP) or "
        "'hf_sharded' (the same under a per-layer sharded wrapper: PyTorch FSDP, DeepSpeed "
        "ZeRO-3), each layer of a pass paying the device's eager per-layer host cost and, "
        "sharded, the wrapper's hooks (planner/cost/peer_engines.py). For pricing runs of "
        "other systems (benchmarks/public_runs); realign runs 'own'.")
    vllm_max_num_seqs: int = Field(
        256, gt=0, description="vLLM: the most sequences one engine decodes at once "
        "(its max_num_seqs; rollout.vllm.max_num_seqs).")
    vllm_kv_cache_bytes: float = Field(
        2 ** 30, gt=0, description="vLLM: the KV cache each engine allocates, bytes per GPU "
        "(rollout.vllm.kv_cache_gib); it also bounds how many sequences decode at once.")
    max_micro_batches: int = Field(
        64, gt=0, description="Largest micro-batch count the search considers.")
    max_ep: int | None = Field(
        None, gt=0, description="Largest expert-parallel degree the search considers for a "
        "mixture of experts (1: no expert parallelism); None: every degree that divides "
        "the experts and the call's dp.")
    reward_s_per_seq: float | None = Field(
        None, ge=0, description="Host seconds a rule reward takes to decode and score one "
        "generated sequence (each rank that generated scores them all, after the "
        "generation). None: timed on this host with the experiment's reward function, "
        "tokenizer and data when the plan uses a profile, else 0 (not priced).")
    batch_s: float | None = Field(
        None, ge=0, description="Host seconds a worker takes to prepare one step's batch "
        "from the dataset (an asynchronous step prepares two: its own and the next "
        "one's). None: timed on this host with the experiment's data and tokenizer when "
        "the plan uses a profile, else 0 (not priced).")
