"""KV-cache forward of one pipeline stage for generation: the decoder's math written
as plain tensor functions over the stage's own megatron parameters, with a per-row
cache so a batch of prompts of different lengths is prefilled in one forward. The
cache-less ``score`` forward is also differentiable (TP collectives through megatron's
autograd-aware mappings), so training can run it under megatron's schedule, DDP and
optimizer (``train.forward``).

Why not megatron's forward: its ``StaticInferenceContext`` keeps one sequence offset
for the whole batch, so prompts of different lengths cannot be prefilled together;
the loop had to walk the prompts one position at a time (a 1000-token prompt beside
a 100-token one cost 900 single-token forwards). Its dynamic engine needs flash-attn
and a global parallel state, and vLLM is GPU-only (not a dependency). The math here is
the same as megatron's layers (pre-norm RMSNorm, grouped-query attention with the
query-group-major QKV layout, RoPE from the model's own ``rotary_pos_emb``, gated
SiLU MLP, vocabulary-parallel embedding and head) and reads the very parameter
tensors megatron trains, so reallocation and training need nothing new. Equality
with megatron's forward (and transformers') is tested at TP1, TP2 and PP2.

Tensors are batch-first: hidden [b, s, h]; cache [b, kv_heads/tp, len, d] per layer.
The cached forwards attend over a key length rounded up to :data:`KEY_BLOCK` (the
extra cache positions are masked out): torch's CPU attention kernels take a slow path
when the key length is not a multiple of the vector width (for 32 prompts of 8
tokens, 8 keys took about twice as long as 16: benchmarks/step/README.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

from planner.cost.cost_config import KV_CACHE_BLOCK_TOKENS
from realign.data.packing import Pack
from realign.runtime.engines.ep_lockstep import announce_forward
from realign.runtime.engines.packed_attention import packed_attention
from realign.runtime.model import TE_NAMES, ModelShard
from realign.runtime.moe import MoeMLP

if TYPE_CHECKING:
    from realign.runtime.engines.captured_step import CapturedSteps

#: cached attention spans whole blocks of this many keys (16 fp32 = one AVX-512 vector);
#: the cache is allocated in such blocks, as the planner prices it
KEY_BLOCK = KV_CACHE_BLOCK_TOKENS


def key_span(n: int) -> int:
    """``n`` keys rounded up to whole :data:`KEY_BLOCK` blocks."""
    return -(-n // KEY_BLOCK) * KEY_BLOCK


@dataclass
class LayerWeights:
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    proj: torch.Tensor
    ln2: torch.Tensor
    fc1: torch.Tensor | None                #: the dense MLP (None on a sparse layer)
    fc2: torch.Tensor | None
    q_norm: torch.Tensor | None = None      #: per-head query RMSNorm (Qwen3)
    k_norm: torch.Tensor | None = None
    #: a sparse layer's router and experts (:mod:`realign.runtime.moe`), in place of fc1/fc2
    moe: MoeMLP | None = None
    #: the layer's megatron modules that carry LoRA adapters, by target
    #: (:mod:`realign.runtime.lora`); empty without LoRA
    lora: dict[str, torch.nn.Module] = field(default_factory=dict)


def layer_weights(layer: torch.nn.Module) -> LayerWeights:
    """The weights of one megatron ``TransformerLayer`` (local or TE spec)."""
    from realign.runtime.lora import adapted, is_lora_name

    p = {TE_NAMES.get(n, n): t for n, t in layer.named_parameters() if not is_lora_name(n)}
    moe = layer.mlp if isinstance(layer.mlp, MoeMLP) else None
    return LayerWeights(
        ln1=p["input_layernorm.weight"], qkv=p["self_attention.linear_qkv.weight"],
        qkv_bias=p.get("self_attention.linear_qkv.bias"),
        proj=p["self_attention.linear_proj.weight"], ln2=p["pre_mlp_layernorm.weight"],
        fc1=p.get("mlp.linear_fc1.weight"), fc2=p.get("mlp.linear_fc2.weight"),
        q_norm=p.get("self_attention.q_layernorm.weight"),
        k_norm=p.get("self_attention.k_layernorm.weight"),
        lora=adapted(layer) if moe is None else {}, moe=moe)     # no LoRA on experts' layers


@dataclass
class StageWeights:
    """The parameter tensors of one pipeline stage the decoder reads (the megatron
    parameters themselves, so training, loading and reallocation show through) and the
    RoPE table up to the model's longest sequence."""

    layers: list[LayerWeights]
    emb: torch.Tensor | None            #: word embeddings (first stage)
    final_norm: torch.Tensor | None     #: last stage
    head: torch.Tensor | None           #: LM head (tied or not) or value head; last stage
    cos: torch.Tensor                   #: [max_seq_len, rot_dim] in the compute dtype
    sin: torch.Tensor


def stage_weights(shard: ModelShard) -> StageWeights:
    """The shard's :class:`StageWeights`, made once and kept on the shard."""
    w = shard.decoder_weights
    if w is None:
        # megatron's ``GPTModel``: its submodules resolve through ``nn.Module.__getattr__``
        m: Any = shard.module
        g = shard.groups
        head = None
        if g.is_last_stage:
            head = (m.shared_embedding_or_output_weight()
                    if m.share_embeddings_and_output_weights else m.output_layer.weight)
        freqs = m.rotary_pos_emb(shard.spec.max_seq_len)[:, 0, 0, :]   # [len, rot_dim] fp32
        dtype = shard.device.dtype
        w = shard.decoder_weights = StageWeights(
            layers=[layer_weights(layer) for layer in m.decoder.layers],
            emb=m.embedding.word_embeddings.weight if g.is_first_stage else None,
            final_norm=m.decoder.final_layernorm.weight if g.is_last_stage else None,
            head=head, cos=freqs.cos().to(dtype), sin=freqs.sin().to(dtype))
    assert isinstance(w, StageWeights)
    return w


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE on [b, s, heads..., d] with cos/sin [b, s, 1..., rot_dim]
    (megatron's ``_apply_rotary_pos_emb_bshd``; dims past rot_dim pass through)."""
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    x = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((x, rest), dim=-1) if rest.shape[-1] else x


class StageDecoder:
    """One call's forward state on this pipeline stage: weights, RoPE table and, for
    generation, a KV cache of ``cache_rows`` rows of up to ``max_len`` positions.

    ``prefill(x, lengths)`` runs right-padded prompts [b, P] into the cache;
    ``step(x, pos, kv_len)`` one new token per row at position ``pos[i]``; both return,
    on the last stage, the full-vocabulary logits [b, padded V] of each row's newest
    position. ``score(x)`` is a plain causal forward without cache that returns, on the
    last stage, the head's output at every position ([b, s, V/tp] vocabulary-parallel
    logits, or [b, s, 1] values), as megatron's ``GPTModel`` does. ``x`` is token ids
    on the first stage and the previous stage's hidden states otherwise; stages other
    than the last return hidden states [b, s, h].
    """

    def __init__(self, shard: ModelShard, max_len: int, cache_rows: int = 0,
                 recompute: bool = False):
        m: Any = shard.module           # megatron's ``GPTModel`` (see stage_weights)
        spec, g = shard.spec, shard.groups
        self.shard, self.spec, self.groups = shard, spec, g
        #: score() under autograd keeps only each layer's input and recomputes the
        #: layer in the backward (the plan's activation_recompute)
        self.recompute = recompute
        tp = g.layout.tp
        self.tp_group = g.pgs.tp if tp > 1 else None
        self.n_groups = spec.n_kv_heads // tp
        self.per_group = spec.n_heads // spec.n_kv_heads
        self.d = spec.kv_channels
        scale = m.config.softmax_scale
        self.scale: float = scale if scale is not None else self.d ** -0.5
        w = stage_weights(shard)
        self.layers, self.emb, self.final_norm, self.head = w.layers, w.emb, w.final_norm, w.head
        dtype, dev = shard.device.dtype, shard.device.device
        self.cos, self.sin = w.cos[:max_len], w.sin[:max_len]
        if max_len > w.cos.shape[0]:         # past the checkpoint's max positions
            freqs = m.rotary_pos_emb(max_len)[:, 0, 0, :]
            self.cos, self.sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        shape = (cache_rows, self.n_groups, key_span(max_len), self.d)
        cached = range(len(self.layers) if cache_rows else 0)
        self.k = [torch.zeros(shape, dtype=dtype, device=dev) for _ in cached]
        self.v = [torch.zeros(shape, dtype=dtype, device=dev) for _ in cached]
        self.rows = torch.arange(max(cache_rows, 1), device=dev)
        #: keys the cache holds per row (whole :data:`KEY_BLOCK` blocks)
        self.cache_keys = shape[2]
        #: the decode steps' captures, when the call replays them
        #: (:func:`~realign.runtime.engines.captured_step.capture_steps`)
        self.replay: CapturedSteps | None = None

    @property
    def cache_bytes(self) -> int:
        """Bytes of this stage's KV cache (keys and values of its layers)."""
        return sum(t.nbytes for t in self.k + self.v)

    # ---- the two entry points ---------------------------------------------------------
    def prefill(self, x: torch.Tensor, lengths: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Right-padded prompts need no mask beyond causality: a prompt position sees
        only earlier positions, all of them its own prompt's; the padding positions'
        outputs are never read, and the cache entries they leave are overwritten by the
        decode steps before any step attends to them. So the attention is
        ``is_causal`` (top-left aligned over the cache's whole key blocks), which lets
        SDPA pick a flash or memory-efficient kernel instead of building the
        [b, heads, s, keys] scores of an explicit mask. ``rows``: the cache rows the
        prompts go to (a refilled slot, :mod:`~realign.runtime.engines.refill`); None:
        rows ``0..b-1``."""
        announce_forward(self.shard)
        b, s = x.shape[:2]
        span = key_span(s)
        pos = torch.arange(s, device=x.device)

        def attend(i, k, v):
            if rows is None:
                self.k[i][:, :, :s] = k
                self.v[i][:, :, :s] = v
                return self.k[i][:, :, :span], self.v[i][:, :, :span]
            self.k[i][rows, :, :s] = k
            self.v[i][rows, :, :s] = v
            return self.k[i][rows, :, :span], self.v[i][rows, :, :span]
        return self._forward(x, pos.unsqueeze(0).expand(b, s), None, attend, lengths - 1)

    def step(self, x: torch.Tensor, pos: torch.Tensor, kv_len: int,
             rows: torch.Tensor | None = None) -> torch.Tensor:
        """``kv_len``: an upper bound of ``pos + 1`` (the cache prefix attended).
        ``rows``: the cache rows ``x`` and ``pos`` are for (None: every row). With
        :attr:`replay` set, the step is replayed from its capture
        (:mod:`~realign.runtime.engines.captured_step`), else run eagerly. With expert
        parallelism both entry points first tell the EP group a forward comes
        (:mod:`~realign.runtime.engines.ep_lockstep`)."""
        announce_forward(self.shard)
        if self.replay is not None:
            return self.replay.step(x, pos, kv_len, rows)
        return self.eager_step(x, pos, kv_len, rows)

    def eager_step(self, x: torch.Tensor, pos: torch.Tensor, kv_len: int,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`step` run op by op: the host issues every layer's kernels."""
        kv_len = key_span(kv_len)
        keys = torch.arange(kv_len, device=x.device)
        mask = (keys.unsqueeze(0) <= pos.unsqueeze(1))[:, None, None, :]  # [b, 1, 1, k]
        at = self.rows if rows is None else rows

        def attend(i, k, v):
            self.k[i][at, :, pos] = k[:, :, 0]
            self.v[i][at, :, pos] = v[:, :, 0]
            if rows is None:
                return self.k[i][:, :, :kv_len], self.v[i][:, :, :kv_len]
            return self.k[i][rows, :, :kv_len], self.v[i][rows, :, :kv_len]
        return self._forward(x, pos.unsqueeze(1), mask, attend, "newest")

    def score(self, x: torch.Tensor, pack: Pack | None = None) -> torch.Tensor:
        """``pack``: ``x`` is a packed micro-batch [bins, width] (realign.data.packing):
        positions restart for each row and attention stays within each row
        (:mod:`~realign.runtime.engines.packed_attention`)."""
        if pack is not None:
            return self._forward(x, pack.positions, pack, _no_cache, "all")
        b, s = x.shape[:2]
        positions = torch.arange(s, device=x.device).unsqueeze(0).expand(b, s)
        return self._forward(x, positions, None, _no_cache, "all")

    # ---- the math ---------------------------------------------------------------------
    def _forward(self, x, positions, mask, attend, out):
        """``out``: which positions the last stage returns: "all" (no vocabulary
        gather), "newest" (the single new one) or a tensor [b] of indices."""
        if self.emb is not None:
            x = self._embed(x)
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)
        checkpoint = self.recompute and attend is _no_cache and torch.is_grad_enabled()
        for i, w in enumerate(self.layers):
            # rollout routing replay's experts, read now: a recomputation replays alike
            replay = w.moe.replay if w.moe is not None else None
            if checkpoint:      # no cache writes in the layer: recomputing it is exact
                x = torch.utils.checkpoint.checkpoint(
                    self._layer, i, w, x, cos, sin, mask, attend, replay, use_reentrant=False)
            else:
                x = self._layer(i, w, x, cos, sin, mask, attend, replay)
        if not self.groups.is_last_stage:
            return x
        every = isinstance(out, str) and out == "all"
        if not every:
            x = (x[:, -1] if isinstance(out, str)
                 else x[torch.arange(x.shape[0], device=x.device), out])     # [b, h]
        x = F.rms_norm(x, (x.shape[-1],), self.final_norm, self.spec.norm_eps)
        x = F.linear(self._copy(x) if self.shard.head == "lm" else x, self.head)
        return x if every else gather_vocab(x, self.tp_group)

    def _layer(self, i, w: LayerWeights, x, cos, sin, mask, attend, replay=None):
        b, s, h = x.shape
        eps, d, ng, r = self.spec.norm_eps, self.d, self.n_groups, self.per_group
        y = F.rms_norm(x, (h,), w.ln1, eps)
        qkv = self._adapt(w, "linear_qkv", y, F.linear(self._copy(y), w.qkv, w.qkv_bias))
        qkv = qkv.view(b, s, ng, r + 2, d)
        qk = qkv[:, :, :, :r + 1]
        if w.q_norm is not None:        # per-head norms on queries and keys, before RoPE
            qk = torch.cat([F.rms_norm(qk[:, :, :, :r], (d,), w.q_norm, eps),
                            F.rms_norm(qk[:, :, :, r:], (d,), w.k_norm, eps)], dim=3)
        qk = rotate(qk, cos.unsqueeze(3), sin.unsqueeze(3))                      # one RoPE
        q, k, v = qk[:, :, :, :r].reshape(b, s, ng * r, d), qk[:, :, :, r], qkv[:, :, :, r + 1]
        keys, values = attend(i, k.transpose(1, 2), v.transpose(1, 2))
        if isinstance(mask, Pack):
            o = packed_attention(q.transpose(1, 2), keys, values, mask, self.scale, r > 1)
        else:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=mask is None,
                scale=self.scale, enable_gqa=r > 1)
        o = o.transpose(1, 2).reshape(b, s, ng * r * d)
        x = x + self._adapt(w, "linear_proj", o, self._reduce(F.linear(o, w.proj)))
        y = F.rms_norm(x, (h,), w.ln2, eps)
        if w.moe is not None:           # routed experts (their TP sum inside)
            return x + w.moe.mlp(y, self._copy, self._reduce, replay)
        assert w.fc1 is not None and w.fc2 is not None     # a dense layer
        gate, up = self._adapt(w, "linear_fc1", y, F.linear(self._copy(y), w.fc1)).chunk(2, dim=-1)
        act = F.silu(gate) * up
        return x + self._adapt(w, "linear_fc2", act, self._reduce(F.linear(act, w.fc2)))

    @staticmethod
    def _adapt(w: LayerWeights, target: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A layer's output plus its LoRA update when it carries one (``x``: its input on
        this rank; ``out``: its base output, summed over TP for a row-parallel layer)."""
        mod = w.lora.get(target)
        if mod is None or mod.lora_off:     # no adapter, or off (the base scored alone)
            return out
        from realign.runtime.lora import lora_delta
        return out + lora_delta(mod, x)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.emb is not None, "token ids reach only the first stage"
        if self.tp_group is None:
            return F.embedding(ids, self.emb)
        rows = self.emb.shape[0]
        local = ids - self.groups.tp_rank * rows
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), self.emb)
        return self._reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of a row-parallel output over the TP group (backward: identity)."""
        if self.tp_group is None:
            return t
        if not torch.is_grad_enabled():
            dist.all_reduce(t, group=self.tp_group)
            return t
        from megatron.core.tensor_parallel.mappings import (
            reduce_from_tensor_model_parallel_region,
        )
        return reduce_from_tensor_model_parallel_region(t, self.tp_group)

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        """The replicated input of a column-parallel weight: identity forward; its
        gradient is summed over the TP group in backward."""
        if self.tp_group is None or not torch.is_grad_enabled():
            return t
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
        )
        return copy_to_tensor_model_parallel_region(t, self.tp_group)


def _no_cache(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the given keys and values only (scoring: no KV cache)."""
    return k, v


def gather_vocab(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather vocabulary-parallel logits [..., V/tp] over the TP group (None: TP 1)."""
    if tp_group is None:
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def run_stage(shard: ModelShard, forward, tokens: torch.Tensor) -> torch.Tensor | None:
    """One forward of this pipeline stage: token ids [b, s] in on the first stage,
    hidden states from the previous stage otherwise. The last stage returns
    ``forward``'s output; the others send their hidden states on and return None."""
    g = shard.groups
    x = tokens
    if not g.is_first_stage:
        x = torch.empty(*tokens.shape, shard.spec.hidden, dtype=shard.device.dtype,
                        device=tokens.device)
        dist.recv(x, src=g.world_rank(g.tp_rank, g.dp_rank, g.pp_rank - 1))
    out = forward(x)
    if not g.is_last_stage:
        dist.send(out.contiguous(), dst=g.world_rank(g.tp_rank, g.dp_rank, g.pp_rank + 1))
        return None
    return out
