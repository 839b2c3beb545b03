"""Memory of an MFC under an allocation, and the sizes it is made of.

Memory (bytes per GPU): weights ``param_dtype x params/tp`` of the heaviest stage, a
mixture of experts' experts further divided by the layout's ``ep`` (each EP rank holds
``n_experts / ep`` of them: weights and gradients fall by ``ep``; with the distributed
optimizer their optimizer state is sharded over the ``dp / ep`` ranks that hold the same
experts, so it stays ``1/dp`` of the model per GPU as without EP);
another system's sharded data-parallel trainer (``train_engine: hf_sharded``: FSDP,
ZeRO-3) keeps ``1/dp`` of a scoring or training call's weights and gradients per GPU, and
one layer's whole weights while it runs;
training adds fp32 main grads and optimizer state (divided by dp with the
distributed optimizer) and 1F1B activations for ``min(pp, m)`` micro-batches in
flight (with activation recompute only each layer's input, plus one layer's
full activations); with optimizer offload the GPU keeps only the fp32 main-weight
shard of the optimizer state, and the step adds the transfers and the host's Adam
(:func:`planner.cost.offload_terms.offload_step_s`); with training-state offload the gradients and the
optimizer state the GPU keeps are there only during the train call (transient, not
resident: between calls the state waits in host memory and the gradients are freed),
and the call adds the state's two transfers (:func:`planner.cost.offload_terms.state_transfer_s`);
inference adds one micro-batch's layer activations and fp32 logits (a packed scoring
or training call with a token budget: of ``budget`` tokens, as a bin never holds more;
otherwise ``rows / m x seq_len`` tokens, the caps);
generation adds the KV cache of the waves in flight (``g`` waves of ``b`` sequences,
each allocated for ``prompt_len + gen_len`` positions rounded up to whole
``kv_cache_block_tokens`` blocks) and the logits of one step.
"""
from __future__ import annotations

from planner.cost.cost_config import CostModelConfig
from planner.cost.lora_terms import adapter_params, trained_params
from planner.graph.dataflow import MFC
from planner.specs.layout import Layout
from planner.specs.lora import LoraSpec
from planner.specs.model_spec import ModelSpec


def stage_params(spec: ModelSpec, head: str, layout: Layout) -> float:
    """Parameters on one GPU of the heaviest pipeline stage (the experts: ``1/ep`` of
    them)."""
    tp, pp = layout.tp, layout.pp
    experts = spec.layer_expert_params()
    per_layer = ((spec.layer_sharded_params() - experts * (1 - 1 / layout.ep)) / tp
                 + spec.layer_replicated_params())
    body = spec.n_layers // pp * per_layer
    first = body + spec.embedding_params() / tp
    head_p: float
    if head == "value":
        head_p = spec.hidden
    elif spec.tied_embeddings and pp == 1:
        head_p = 0.0
    else:
        head_p = spec.embedding_params() / tp
    last = body + spec.hidden + head_p
    return first + spec.hidden + head_p if pp == 1 else max(first, last)

def stage_expert_params(spec: ModelSpec, layout: Layout) -> float:
    """The experts' parameters on one GPU of a stage (``1/(tp ep)`` of its sparse
    layers' experts); 0 for a dense model."""
    return spec.n_layers // layout.pp * spec.layer_expert_params() / (layout.tp * layout.ep)


def optimizer_shard_params(spec: ModelSpec, layout: Layout, p_gpu: float,
                           distributed: bool) -> float:
    """Parameters whose optimizer state one GPU keeps, of the ``p_gpu`` it trains: all of
    them, or with the distributed optimizer a ``1/dp`` share of the dense ones and a
    ``1/(dp/ep)`` share of its experts (sharded over the ranks holding the same experts).

    Example: 100 dense and 40 expert parameters per GPU, dp 4, ep 2: 100/4 + 40/2 = 45."""
    if not distributed:
        return p_gpu
    if layout.ep == 1:
        return p_gpu / layout.dp
    experts = stage_expert_params(spec, layout)
    return (p_gpu - experts) / layout.dp + experts / (layout.dp // layout.ep)


def trainable_params(spec: ModelSpec, head: str, layout: Layout,
                     lora: LoraSpec | None) -> float:
    """Trained parameters on one GPU of the heaviest stage: all of them, or with LoRA
    (:func:`planner.cost.lora_terms.trained_params`)."""
    if lora is None:
        return stage_params(spec, head, layout)
    return trained_params(spec, head, layout, lora)

def act_bytes_per_token_layer(config: CostModelConfig, spec: ModelSpec, tp: int) -> float:
    """Stored activations of one token in one layer (flash attention)."""
    dt = config.param_dtype_bytes
    sharded = spec.qkv_out + spec.n_heads * spec.kv_channels + spec.mlp_activation_width()
    return dt * (5 * spec.hidden + sharded / tp)

def kv_cache_bytes(config: CostModelConfig, spec: ModelSpec, mfc: MFC, layout: Layout,
                   waves: int) -> float:
    """Peak KV-cache bytes per GPU of a generation run as ``waves`` waves: the
    ``min(waves, pp)`` waves in flight, each ``n_seqs / (dp waves)`` sequences of
    ``prompt_len + gen_len`` positions rounded up to whole cache blocks, keys and
    values of the stage's ``L / pp`` layers for its ``n_kv_heads / tp`` heads.

    Example: 2 layers, 2 KV heads of 16, fp32, 64 sequences at dp 1 in 2 waves,
    8 + 4 tokens (one 16-token block): 32 sequences x 2 layers x (2 x 2 x 16 x 4) bytes
    x 16 positions = 262144 bytes.
    """
    tp, pp = layout.tp, layout.pp
    in_flight = min(waves, pp) * mfc.n_seqs / layout.dp / waves
    return in_flight * wave_kv_bytes_per_seq(config, spec, mfc, tp, pp)

def wave_kv_bytes_per_seq(config: CostModelConfig, spec: ModelSpec, mfc: MFC, tp: int,
                          pp: int) -> float:
    """KV-cache bytes of one sequence of a wave on one GPU (whole cache blocks)."""
    block = config.kv_cache_block_tokens
    positions = -(-(mfc.prompt_len + mfc.gen_len) // block) * block
    per_token_layer = 2 * (spec.n_kv_heads / tp) * spec.kv_channels * config.param_dtype_bytes
    return spec.n_layers / pp * per_token_layer * positions


def mfc_memory(cfg: CostModelConfig, mfc: MFC, spec: ModelSpec, head: str, layout: Layout,
               m: int, offload: bool = False, recompute: bool = False,
               lora: LoraSpec | None = None, token_budget: int | None = None
               ) -> tuple[float, float, float, float]:
    """(weights, resident, activation, host) bytes per GPU of ``mfc`` at ``layout`` with
    ``m`` micro-batches, or for a packed scoring or training call bins of at most
    ``token_budget`` tokens (``m`` their expected count; the module docstring)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    dt = cfg.param_dtype_bytes
    weights = dt * (stage_params(spec, head, layout)
                    + adapter_params(spec, head, layout, lora))
    # gradients and optimizer state: of every parameter, or with LoRA of the adapters
    p_gpu = trainable_params(spec, head, layout, lora)
    logit_cols = spec.padded_vocab / tp if head == "lm" else 1.0
    gathered = 0.0
    if cfg.train_engine == "hf_sharded" and mfc.kind != "generate":
        # a sharded data-parallel trainer (FSDP, ZeRO-3) keeps 1/dp of the weights and
        # gradients on each rank, and one layer's whole weights while it runs
        gathered = weights / max(1, spec.n_layers // pp)
        weights, p_gpu = weights / dp, p_gpu / dp
    if mfc.kind == "generate":
        b = mfc.n_seqs / dp / m
        act = (kv_cache_bytes(cfg, spec, mfc, layout, m) + 4.0 * b * logit_cols * 2
               + b * mfc.prompt_len * act_bytes_per_token_layer(cfg, spec, tp))
        return weights, weights, act, 0.0
    train = mfc.kind == "train"
    seqs = mfc.n_seqs / (mfc.n_minibatches if train else 1) / dp
    tok = seqs / m * mfc.seq_len if token_budget is None else float(token_budget)
    act_layer = tok * act_bytes_per_token_layer(cfg, spec, tp)
    if not train:
        return weights, weights, 2 * act_layer + 2 * 4.0 * tok * logit_cols + gathered, 0.0
    in_flight = min(pp, m)
    if lora is not None:    # each target keeps x A^T ([tokens, A's rows]) for the backward
        act_layer += tok * lora.z_width() * dt
    per_layer = (tok * spec.hidden * dt) if recompute else act_layer
    act = in_flight * spec.n_layers / pp * per_layer + (act_layer if recompute else 0)
    act += 2 * 4.0 * tok * logit_cols + 2 * gathered
    shard = optimizer_shard_params(spec, layout, p_gpu, cfg.distributed_optimizer
                                   and gathered == 0.0)
    if offload:
        # megatron's HybridDeviceOptimizer: the GPU keeps the fp32 main-weight shard
        # (4 bytes); the host its fp32 copy, Adam's m and v and pinned fp32 grads
        resident = weights + p_gpu * cfg.grad_dtype_bytes + 4 * shard
        host = (cfg.optimizer_state_bytes_per_param + cfg.grad_dtype_bytes) * shard
        return weights, resident, act, host
    resident = weights + p_gpu * cfg.grad_dtype_bytes + cfg.optimizer_state_bytes_per_param * shard
    return weights, resident, act, 0.0
