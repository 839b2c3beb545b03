"""The logical parameter tensors of a model and how a layout shards them.

This is the one description of "who holds which slice" that both the planner's
reallocation cost and the runtime's reallocation executor use. Names follow
megatron-core's GPTModel with the local layer spec, with *global* layer numbers
(the runtime maps them to stage-local numbers).

Sharding: a TP-sharded tensor is split along ``shard_dim`` into ``tp`` equal shards;
a tensor with ``parts=2`` (SwiGLU fc1 = [gate; up]) is split part by part, so TP
rank ``i`` holds rows ``[p*n/2 + i*n/(2*tp), p*n/2 + (i+1)*n/(2*tp))`` of each part
``p``. Replicated tensors (RMSNorm weights, a value head) are whole on every TP rank.

A sparse layer of a mixture of experts (:class:`~planner.specs.model_spec.MoeSpec`)
holds, in place of the MLP's fc1 and fc2, the router ``mlp.router.weight``
([experts, hidden], whole on every TP rank) and each expert's
``mlp.experts.local_experts.<e>.linear_fc1.weight`` / ``linear_fc2.weight``, split by TP
as the dense MLP's are (megatron-core's ``SequentialMLP`` names).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.specs.model_spec import ModelSpec


@dataclass(frozen=True)
class LogicalTensor:
    """One parameter tensor of the full (unsharded) model."""

    name: str                 #: megatron-style name with the global layer number
    shape: tuple[int, ...]    #: full shape
    shard_dim: int | None     #: dimension TP splits, None when replicated
    parts: int                #: independently sharded parts along shard_dim
    content: str              #: what the values are (a tied output copy = "embedding")
    layer: int | None         #: global layer number, None for embedding/head/final norm

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one TP rank's local shard. fc1 (352, 64) at tp=4 -> (88, 64)."""
        if self.shard_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.shard_dim] //= tp
        return tuple(shape)

    def shard_ranges(self, tp_rank: int, tp: int) -> list[tuple[int, int]]:
        """Global index ranges along ``shard_dim`` held by ``tp_rank`` of ``tp``."""
        assert self.shard_dim is not None
        n = self.shape[self.shard_dim]
        part = n // self.parts
        step = part // tp
        return [(p * part + tp_rank * step, p * part + (tp_rank + 1) * step)
                for p in range(self.parts)]


def layer_tensors(spec: ModelSpec, layer: int) -> list[LogicalTensor]:
    h, f = spec.hidden, spec.ffn_hidden
    pre = f"decoder.layers.{layer}."
    t = [
        LogicalTensor(pre + "input_layernorm.weight", (h,), None, 1, pre + "ln1", layer),
        LogicalTensor(pre + "self_attention.linear_qkv.weight", (spec.qkv_out, h), 0, 1,
                      pre + "qkv", layer),
    ]
    if spec.qkv_bias:
        t.append(LogicalTensor(pre + "self_attention.linear_qkv.bias", (spec.qkv_out,), 0, 1,
                               pre + "qkv_bias", layer))
    if spec.qk_norm:        # per-head norms: one weight of the head size, on every TP rank
        d = spec.kv_channels
        t += [LogicalTensor(pre + "self_attention.q_layernorm.weight", (d,), None, 1,
                            pre + "q_norm", layer),
              LogicalTensor(pre + "self_attention.k_layernorm.weight", (d,), None, 1,
                            pre + "k_norm", layer)]
    t += [
        LogicalTensor(pre + "self_attention.linear_proj.weight",
                      (h, spec.n_heads * spec.kv_channels), 1, 1, pre + "proj", layer),
        LogicalTensor(pre + "pre_mlp_layernorm.weight", (h,), None, 1, pre + "ln2", layer),
    ]
    if spec.moe is not None and spec.is_sparse(layer):
        return t + expert_tensors(spec, layer)
    t += [
        LogicalTensor(pre + "mlp.linear_fc1.weight", (2 * f, h), 0, 2, pre + "fc1", layer),
        LogicalTensor(pre + "mlp.linear_fc2.weight", (h, f), 1, 1, pre + "fc2", layer),
    ]
    return t


def expert_tensors(spec: ModelSpec, layer: int) -> list[LogicalTensor]:
    """The router and the experts of sparse layer ``layer``; an expert's content is
    ``decoder.layers.<i>.experts.<e>.expert_fc1`` (``expert_fc2``)."""
    assert spec.moe is not None
    h, f, pre = spec.hidden, spec.moe.expert_ffn_hidden, f"decoder.layers.{layer}."
    t = [LogicalTensor(pre + "mlp.router.weight", (spec.moe.n_experts, h), None, 1,
                       pre + "router", layer)]
    for e in range(spec.moe.n_experts):
        ex = f"{pre}mlp.experts.local_experts.{e}."
        t += [LogicalTensor(ex + "linear_fc1.weight", (2 * f, h), 0, 2,
                            f"{pre}experts.{e}.expert_fc1", layer),
              LogicalTensor(ex + "linear_fc2.weight", (h, f), 1, 1,
                            f"{pre}experts.{e}.expert_fc2", layer)]
    return t


def stage_tensors(spec: ModelSpec, head: str, pp: int, stage: int) -> list[LogicalTensor]:
    """Tensors held by pipeline stage ``stage`` of ``pp`` (every TP rank of it).

    The first stage holds the embedding, the last the final norm and the head. With
    tied embeddings and pp > 1 the last stage keeps its own copy of the embedding as
    ``output_layer.weight`` (megatron-core does this), whose content is the embedding.
    """
    v, h = spec.padded_vocab, spec.hidden
    out: list[LogicalTensor] = []
    if stage == 0:
        out.append(LogicalTensor("embedding.word_embeddings.weight", (v, h), 0, 1,
                                 "embedding", None))
    per = spec.n_layers // pp
    for layer in range(stage * per, (stage + 1) * per):
        out += layer_tensors(spec, layer)
    if stage == pp - 1:
        out.append(LogicalTensor("decoder.final_layernorm.weight", (h,), None, 1,
                                 "final_norm", None))
        if head == "value":
            out.append(LogicalTensor("output_layer.weight", (1, h), None, 1, "value_head", None))
        elif not spec.tied_embeddings:
            out.append(LogicalTensor("output_layer.weight", (v, h), 0, 1, "output", None))
        elif pp > 1:
            out.append(LogicalTensor("output_layer.weight", (v, h), 0, 1, "embedding", None))
    return out


def all_tensors(spec: ModelSpec, head: str) -> list[LogicalTensor]:
    """Every tensor of the model at pp=1 (each content once)."""
    return stage_tensors(spec, head, 1, 0)
