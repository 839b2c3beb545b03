"""LLaMA-family decoders (LLaMA-2/3, Qwen2/2.5, Qwen3, Mistral) as megatron-core ``GPTModel``
shards of one replica, with a language-model head or a scalar value head, and the
adapter from local megatron parameters to the planner's logical tensors.

megatron's local (non-TE) layer spec holds the parameters unless
``train.transformer_engine`` opts in to TE's spec (CUDA only). The vocabulary is padded to
:attr:`planner.specs.model_spec.ModelSpec.padded_vocab` (the same for every TP). A
mixture of experts' sparse layers (Qwen3-MoE) hold realign's
:class:`~realign.runtime.moe.MoeMLP` in place of megatron's MLP.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from planner.specs.layout import stage_layers
from planner.specs.lora import LoraSpec, moved_stage_tensors
from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import stage_tensors
from realign.runtime.device import DeviceInfo
from realign.runtime.ep_groups import holds_tensor
from realign.runtime.groups import ReplicaGroups

if TYPE_CHECKING:     # megatron-core ships no type information: this names an Any
    from megatron.core.models.gpt import GPTModel

Head = Literal["lm", "value"]

#: Transformer-Engine's fused modules keep the norms inside the linear layers; these
#: are the local-spec names the planner uses for them.
TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclass
class ModelShard:
    """This process's shard of one replica."""

    spec: ModelSpec
    head: Head
    groups: ReplicaGroups
    device: DeviceInfo
    module: torch.nn.Module        #: the megatron ``GPTModel`` (unwrapped)
    #: the plain decoder's view of ``module``'s parameters, made on first use
    #: (:func:`realign.runtime.engines.decoder.stage_weights`)
    decoder_weights: object = field(default=None, repr=False, compare=False)
    #: LoRA adapters on its frozen base (:func:`realign.runtime.lora.attach_lora`)
    lora: LoraSpec | None = None
    #: a LoRA value model's checkpoint head (last stage), frozen beside the head it trains:
    #: what it scores with its adapters off (:func:`realign.runtime.lora.adapters_disabled`)
    base_head: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def config(self):
        return self.module.config


class ValueHead(torch.nn.Module):
    """Scalar head ``hidden -> 1`` replicated on every TP rank (critic, reward model).

    Called like megatron's output layer: ``(hidden [s, b, h]) -> ([s, b, 1], None)``.
    """

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden, dtype=dtype, device=device))
        torch.nn.init.normal_(self.weight, std=hidden ** -0.5)

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return F.linear(hidden, self.weight), None


def transformer_config(spec: ModelSpec, groups: ReplicaGroups, device: DeviceInfo,
                       init_weights: bool = True, use_te: bool = False):
    """megatron ``TransformerConfig`` of ``spec`` under the replica's layout. The fused
    kernels (persistent layer norm, masked-softmax and bias-dropout fusion) are TE's
    and apex's: on only with the TE layer spec (the local spec's norm asserts that
    ``persist_layer_norm`` is off, its fused softmax needs apex)."""
    from megatron.core.transformer import TransformerConfig

    from realign.runtime.rope import softmax_scale

    return TransformerConfig(
        num_layers=spec.n_layers, hidden_size=spec.hidden,
        num_attention_heads=spec.n_heads, num_query_groups=spec.n_kv_heads,
        kv_channels=spec.kv_channels, ffn_hidden_size=spec.ffn_hidden,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=groups.layout.tp,
        pipeline_model_parallel_size=groups.layout.pp,
        params_dtype=device.dtype, bf16=device.dtype == torch.bfloat16,
        pipeline_dtype=device.dtype,
        use_cpu_initialization=device.kind == "cpu", perform_initialization=init_weights,
        bias_dropout_fusion=use_te, apply_rope_fusion=False,
        masked_softmax_fusion=use_te, gradient_accumulation_fusion=False,
        persist_layer_norm=use_te, bias_activation_fusion=False,
        attention_softmax_in_fp32=True,
        qk_layernorm=spec.qk_norm, softmax_scale=softmax_scale(spec),
    )


def layer_spec(use_te: bool, qk_norm: bool = False):
    """megatron's local layer spec, or Transformer-Engine's (``train.transformer_engine``);
    ``qk_norm``: per-head RMSNorm on queries and keys (``q_layernorm``, ``k_layernorm``)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)


def check_te(device: DeviceInfo) -> None:
    """A :class:`UserError` unless Transformer-Engine can serve this device: CUDA, and
    ``transformer_engine`` importable (a half-installed TE raises more than
    ImportError: any failure counts)."""
    from realign.errors import UserError

    if device.kind != "cuda":
        raise UserError("Transformer-Engine runs on CUDA only; leave it off on cpu",
                        field="train.transformer_engine")
    try:
        import transformer_engine  # noqa: F401
    except Exception as e:  # noqa: BLE001 (ImportError, OSError, RuntimeError, ...)
        raise UserError(f"transformer_engine does not import ({type(e).__name__}: {e}); "
                        "install it or leave train.transformer_engine off",
                        field="train.transformer_engine") from None


def stage_layer_spec(spec: ModelSpec, use_te: bool, pp: int, pp_rank: int):
    """The layer spec of one pipeline stage: :func:`layer_spec` for every layer of a
    dense model; for a mixture of experts one spec per layer, its sparse layers with no
    megatron MLP (:func:`build_model` puts a :class:`~realign.runtime.moe.MoeMLP` there)."""
    from dataclasses import replace

    base = layer_spec(use_te, spec.qk_norm)
    if spec.moe is None:
        return base
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
    )

    sparse = replace(base, submodules=replace(base.submodules, mlp=IdentityOp))
    return TransformerBlockSubmodules(
        layer_specs=[sparse if spec.is_sparse(i) else base
                     for i in stage_layers(spec.n_layers, pp, pp_rank)],
        layer_norm=LayerNormImpl)


def ensure_process_state(seed: int, tp_rank: int) -> None:
    """Per-process megatron state the layers read: the attention's global memory
    buffer and the RNG tracker. Shared by every replica of the process (dropout is
    off, so the tracker only has to exist)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    tracker = mrandom.get_cuda_rng_tracker()
    if not tracker.get_states():
        cpu_state = torch.get_rng_state()
        mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
        torch.set_rng_state(cpu_state)


def build_model(spec: ModelSpec, head: Head, groups: ReplicaGroups, device: DeviceInfo,
                seed: int = 1234, init_weights: bool = True, use_te: bool = False
                ) -> ModelShard:
    """Build this process's ``GPTModel`` shard of the replica (members only).

    ``init_weights=False`` skips random initialisation (weights come from a checkpoint).
    ``use_te``: Transformer-Engine's layer spec (:func:`check_te` first). Collective over
    the replica's embedding group when embeddings are tied and pp > 1.
    """
    from megatron.core.models.gpt import GPTModel

    from realign.runtime.rope import scaled_rope

    assert groups.member, "only ranks of the replica's mesh build its model"
    ensure_process_state(seed, groups.tp_rank)
    config = transformer_config(spec, groups, device, init_weights, use_te)
    tied = spec.tied_embeddings and head == "lm"
    torch.manual_seed(seed)
    model = GPTModel(
        config, stage_layer_spec(spec, use_te, groups.layout.pp, groups.pp_rank),
        vocab_size=spec.padded_vocab,
        max_sequence_length=spec.max_seq_len,
        pre_process=groups.is_first_stage, post_process=groups.is_last_stage,
        share_embeddings_and_output_weights=tied, position_embedding_type="rope",
        rotary_base=int(spec.rope_theta), pg_collection=groups.pgs)
    if head == "value" and groups.is_last_stage:
        model.output_layer = ValueHead(spec.hidden, device.dtype, device.device)
    if spec.moe is not None:
        _add_experts(model, spec, groups, device, seed if init_weights else None,
                     config.init_method_std)
    rope = scaled_rope(spec, device.device)
    if rope is not None:        # the checkpoint's scaled frequencies (realign.runtime.rope)
        model.rotary_pos_emb.inv_freq = rope[0]
    model.to(device.device)
    # every parameter in the run's dtype: the local spec's torch norms are made in fp32
    # whatever params_dtype says (megatron-LM casts its Float16Module whole; TE's norms
    # follow params_dtype). The optimizer keeps fp32 main copies either way.
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != device.dtype:
                p.data = p.data.to(device.dtype)
    shard = ModelShard(spec=spec, head=head, groups=groups, device=device, module=model)
    _mark_tp_params(shard)
    return shard


def _add_experts(model: GPTModel, spec: ModelSpec, groups: ReplicaGroups,
                 device: DeviceInfo, seed: int | None, std: float) -> None:
    """Each sparse layer of the stage gets its router and experts (random from ``seed``,
    or zeros to load into)."""
    from realign.runtime.moe import MoeMLP

    g = groups
    tp_group = g.pgs.tp if g.layout.tp > 1 else None
    for layer, global_layer in zip(model.decoder.layers,
                                   stage_layers(spec.n_layers, g.layout.pp, g.pp_rank)):
        if spec.is_sparse(global_layer):
            layer.mlp = MoeMLP(spec, global_layer, g.layout.tp, g.tp_rank, tp_group,
                               device.dtype, device.device, seed, std,
                               g.ep, g.ep_rank, g.ep_group)


def _mark_tp_params(shard: ModelShard) -> None:
    """Set megatron's ``tensor_model_parallel`` attributes from the planner's tensors.

    megatron sets them only while initialising weights; a model built without
    initialisation (weights from a checkpoint) would otherwise have its sharded
    weights counted as TP duplicates in the grad norm."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    g = shard.groups
    tensors = {t.name: t for t in stage_tensors(shard.spec, shard.head, g.layout.pp, g.pp_rank)}
    for name, param in shard.module.named_parameters():
        t = tensors[global_name(name, shard.spec, g.layout.pp, g.pp_rank)]
        if t.shard_dim is not None and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, True, t.shard_dim, 1)


# ---- logical tensors -----------------------------------------------------------------

def global_name(local_name: str, spec: ModelSpec, pp: int, pp_rank: int) -> str:
    """Megatron parameter name (stage-local layer number, local or TE spec) -> the
    planner's logical name (global layer number, local-spec names).

    ``decoder.layers.1.mlp.linear_fc1.weight`` on stage 1 of pp=2 with 4 layers ->
    ``decoder.layers.3.mlp.linear_fc1.weight``.
    """
    name = local_name.removeprefix("module.")
    if not name.startswith("decoder.layers."):
        return name
    _, _, idx, rest = name.split(".", 3)
    rest = TE_NAMES.get(rest, rest)
    layer = stage_layers(spec.n_layers, pp, pp_rank)[int(idx)]
    return f"decoder.layers.{layer}.{rest}"


def logical_shards(model: ModelShard | torch.nn.Module, layout, pp_rank: int,
                   spec: ModelSpec | None = None, head: Head | None = None,
                   moved: bool = False) -> dict[str, torch.Tensor]:
    """Each local parameter of a stage's megatron model under the planner's logical
    name (:func:`planner.specs.param_layout.stage_tensors`). Values are the parameters'
    data tensors themselves: writing into them updates the model.

    ``model`` is a :class:`ModelShard` (spec and head taken from it) or a bare
    ``GPTModel`` / DDP-wrapped model with ``spec`` and ``head`` given. Raises if the
    model's parameters do not match the planner's tensors and shard shapes, so the
    reallocation executor and the planner cannot silently disagree.

    With expert parallelism, a shard holds only its EP rank's experts
    (:func:`realign.runtime.ep_groups.holds_tensor`).

    By default the base weights (LoRA adapters left out); ``moved``: what a reallocation
    moves (:func:`planner.specs.lora.moved_stage_tensors`: a LoRA model's adapters and
    value head only).
    """
    lora = None
    if isinstance(model, ModelShard):
        spec, head, module, lora = model.spec, model.head, model.module, model.lora
    else:
        module = model
    assert spec is not None and head is not None, "give spec and head with a bare module"
    if moved:       # what a reallocation moves: everything, or a LoRA model's trained part
        tensors = moved_stage_tensors(spec, head, lora, layout.pp, pp_rank)
    else:           # the base weights (a checkpoint's tensors)
        tensors = stage_tensors(spec, head, layout.pp, pp_rank)
    expected = {t.name: t for t in tensors}
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        logical = global_name(name, spec, layout.pp, pp_rank)
        if logical not in expected and ((moved and lora is not None)
                                         or name.rsplit(".", 1)[-1] in ("lora_A", "lora_B")):
            continue        # a base weight a LoRA reallocation leaves, or an adapter
        if logical not in expected:
            raise ValueError(f"megatron parameter {name!r} (logical {logical!r}) is not among "
                             f"the planner's tensors of stage {pp_rank}")
        want = expected[logical].shard_shape(layout.tp)
        if tuple(param.shape) != want:
            raise ValueError(f"{logical}: local shard has shape {tuple(param.shape)}, the "
                             f"planner expects {want} at tp={layout.tp}")
        out[logical] = param.data
    missing = sorted(set(expected) - set(out))
    if isinstance(model, ModelShard) and model.groups.ep > 1:   # other EP ranks' experts
        assert spec.moe is not None
        g = model.groups
        missing = [n for n in missing if holds_tensor(n, spec.moe.n_experts, g.ep, g.ep_rank)]
    if missing:
        raise ValueError(f"stage {pp_rank} lacks the planner's tensors {missing}")
    return out
