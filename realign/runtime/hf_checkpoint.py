"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (one file or a
sharded ``model.safetensors.index.json``).

Loading: each rank reads only the slices its shard needs (``safe_open(...).get_slice``).
All metadata checks (architecture, shapes against the config) run before any
collective, from the safetensors headers alone.

Name and layout mapping (HF -> megatron local spec, per layer ``i``; the HF names are
the family's table, :mod:`planner.specs.families`):

* ``q_proj``, ``k_proj``, ``v_proj`` -> ``linear_qkv``: megatron groups the rows per
  KV head: ``[q heads of group 0; k0; v0; q heads of group 1; k1; v1; ...]``, so a TP
  rank's contiguous row range is whole KV groups (biases likewise);
* ``q_norm``, ``k_norm`` (Qwen3) -> ``q_layernorm``, ``k_layernorm`` (whole on every rank);
* ``gate_proj``, ``up_proj`` -> ``linear_fc1`` = ``[gate; up]``, split part by part;
* ``o_proj`` -> ``linear_proj``, ``down_proj`` -> ``linear_fc2`` (column-sharded);
* ``input_layernorm`` / ``post_attention_layernorm`` -> ``input_layernorm`` /
  ``pre_mlp_layernorm``; ``model.norm`` -> ``decoder.final_layernorm``;
* ``model.embed_tokens`` / ``lm_head`` -> embedding / ``output_layer`` (vocabulary
  rows padded with zeros to the padded size); ``score`` (a sequence-classification
  reward model) -> the value head;
* a mixture of experts' sparse layer (Qwen3-MoE): ``mlp.gate`` -> ``mlp.router`` (whole
  on every rank); ``mlp.experts.<e>.gate_proj`` / ``up_proj`` -> that expert's
  ``linear_fc1``, ``down_proj`` -> its ``linear_fc2`` (split as the dense MLP's).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from planner.errors import PlanError
from planner.specs.families import FAMILIES
from planner.specs.families.base import MODEL_NAMES
from planner.specs.model_spec import ModelSpec, model_spec_from_hf_config
from planner.specs.param_layout import LogicalTensor, stage_tensors
from realign.errors import UserError

if TYPE_CHECKING:
    from safetensors import safe_open

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


# ---- config -------------------------------------------------------------------------

def read_hf_config(path: str | Path) -> dict:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise UserError(f"no config.json in {str(path)!r}", field="model.path")
    return json.loads(p.read_text())


def spec_from_hf(path: str | Path, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a HF checkpoint folder: its family's config mapping
    (:mod:`planner.specs.families`), which refuses what realign does not run (another
    ``model_type``, experts in a dense family, an unknown rope scaling, sliding windows
    on some layers only) and caps ``max_seq_len`` at a sliding window."""
    read_hf_config(path)                  # a folder without config.json says so
    try:
        return model_spec_from_hf_config(path, name)
    except PlanError as e:
        raise UserError(e.message, field="model.path") from None


# ---- name mapping -------------------------------------------------------------------

def hf_names(t: LogicalTensor, spec: ModelSpec) -> list[str]:
    """HF tensor names a logical tensor is made of (in concatenation order): the
    family's table (:mod:`planner.specs.families`), read and written alike."""
    if t.layer is not None:
        parts = t.content.split(".")
        kind = parts[-1]
        expert = int(parts[-2]) if kind.startswith("expert_") else None
        return [f"model.layers.{t.layer}.{n}"
                for n in FAMILIES[spec.family].layer_names(kind, expert)]
    return list(MODEL_NAMES[t.content])


def _fc1(t: LogicalTensor) -> bool:
    """``t`` is a SwiGLU fc1 (the dense MLP's or an expert's): HF's gate and up."""
    return t.content.endswith(".fc1") or t.content.endswith(".expert_fc1")


def hf_shapes(t: LogicalTensor, spec: ModelSpec) -> list[tuple[int, ...]]:
    """Shapes the HF tensors of :func:`hf_names` must have."""
    h, d, v = spec.hidden, spec.kv_channels, spec.vocab_size
    if t.content.endswith(".qkv") or t.content.endswith(".qkv_bias"):
        rows = [spec.n_heads * d, spec.n_kv_heads * d, spec.n_kv_heads * d]
        return [(r, h) if t.content.endswith(".qkv") else (r,) for r in rows]
    if _fc1(t):
        return [(t.shape[0] // 2, h)] * 2
    if t.content in ("embedding", "output"):
        return [(v, h)]
    return [t.shape]


# ---- reading ------------------------------------------------------------------------

class HFReader:
    """Lazy access to the tensors of a HF checkpoint folder (single or sharded)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise UserError(f"{index} is not a safetensors index ({e!r})",
                                field="model.path") from None
        elif (self.path / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise UserError(f"{str(path)!r} holds neither {SINGLE} nor {INDEX}: no weights",
                            field="model.path")
        from safetensors import safe_open

        self._handles: dict[str, safe_open] = {}
        self._where: dict[str, str] = {}
        for f in files:
            try:
                h = safe_open(str(self.path / f), framework="pt", device="cpu")
                names = list(h.keys())
            except Exception as e:  # safetensors' own error type, OSError, ...
                raise UserError(f"{self.path / f} is not a readable safetensors file "
                                f"({type(e).__name__}: {e})", field="model.path") from None
            self._handles[f] = h
            for k in names:
                self._where[k] = f

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int, dim: int = 0) -> torch.Tensor:
        """Rows (``dim=0``) or columns (``dim=1``) ``[start, stop)`` of a tensor, read
        without loading the rest of it."""
        sl = self._handles[self._where[name]].get_slice(name)
        if dim == 0:
            return sl[start:stop]
        return sl[:, start:stop]

    def whole(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)


def check_checkpoint(reader: HFReader, spec: ModelSpec, head: str) -> None:
    """Raise :class:`UserError` unless every tensor the model needs is present with the
    shape its config implies. Reads headers only; call it before any collective."""
    for t in stage_tensors(spec, head, 1, 0):
        for name, want in zip(hf_names(t, spec), hf_shapes(t, spec)):
            if not reader.has(name):
                raise UserError(f"tensor {name!r} is missing (needed for a {head} head)",
                                field="model.path")
            got = reader.shape(name)
            if got != want:
                raise UserError(f"tensor {name!r} has shape {got} but config.json implies "
                                f"{want}", field="model.path")


def read_shard(reader: HFReader, spec: ModelSpec, t: LogicalTensor, tp_rank: int,
               tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of logical tensor ``t`` in megatron's layout."""
    names = hf_names(t, spec)
    if t.shard_dim is None:
        return reader.whole(names[0])
    if t.content.endswith(".qkv") or t.content.endswith(".qkv_bias"):
        d, groups = spec.kv_channels, spec.n_kv_heads
        q_per = spec.n_heads // groups
        g0, g1 = tp_rank * groups // tp, (tp_rank + 1) * groups // tp
        q = reader.rows(names[0], g0 * q_per * d, g1 * q_per * d)
        k = reader.rows(names[1], g0 * d, g1 * d)
        v = reader.rows(names[2], g0 * d, g1 * d)
        rest = q.shape[1:]
        parts = [q.reshape(g1 - g0, q_per * d, *rest), k.reshape(g1 - g0, d, *rest),
                 v.reshape(g1 - g0, d, *rest)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)
    ranges = t.shard_ranges(tp_rank, tp)
    if _fc1(t):
        part = t.shape[0] // 2
        return torch.cat([reader.rows(n, a - p * part, b - p * part)
                          for p, (n, (a, b)) in enumerate(zip(names, ranges))])
    (a, b), = ranges
    if t.content in ("embedding", "output"):      # vocabulary rows, zero padding
        stop = min(b, spec.vocab_size)
        have = reader.rows(names[0], a, stop) if stop > a else None
        out = torch.zeros(b - a, spec.hidden, dtype=have.dtype if have is not None
                          else torch.float32)
        if have is not None:
            out[: stop - a] = have
        return out
    return reader.rows(names[0], a, b, dim=t.shard_dim)


def load_hf_weights(shard, path: str | Path, reader: HFReader | None = None) -> None:
    """Copy this rank's slices of the HF checkpoint at ``path`` into ``shard`` (a
    :class:`realign.runtime.model.ModelShard`). No collectives."""
    from realign.runtime.model import logical_shards

    reader = reader or HFReader(path)
    g = shard.groups
    tensors = {t.name: t for t in stage_tensors(shard.spec, shard.head, g.layout.pp, g.pp_rank)}
    with torch.no_grad():
        for name, dst in logical_shards(shard, g.layout, g.pp_rank).items():
            src = read_shard(reader, shard.spec, tensors[name], g.tp_rank, g.layout.tp)
            dst.copy_(src.to(dst.dtype))


# ---- writing ------------------------------------------------------------------------

def to_hf(t: LogicalTensor, full: torch.Tensor, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A full logical tensor in megatron's layout -> its HF tensors."""
    names = hf_names(t, spec)
    if t.content.endswith(".qkv") or t.content.endswith(".qkv_bias"):
        d, groups = spec.kv_channels, spec.n_kv_heads
        q_per = spec.n_heads // groups
        rest = full.shape[1:]
        g = full.reshape(groups, (q_per + 2) * d, *rest)
        q, k, v = g.split([q_per * d, d, d], dim=1)
        return {n: x.reshape(-1, *rest).contiguous() for n, x in zip(names, (q, k, v))}
    if _fc1(t):
        gate, up = full.chunk(2)
        return {names[0]: gate.contiguous(), names[1]: up.contiguous()}
    if t.content in ("embedding", "output"):
        return {names[0]: full[: spec.vocab_size].contiguous()}
    return {names[0]: full.contiguous()}


def gather_full(t: LogicalTensor, local: torch.Tensor, tp_group, tp: int) -> torch.Tensor:
    """All-gather a TP-sharded logical tensor over ``tp_group`` into its full shape."""
    if t.shard_dim is None or tp == 1:
        return local.detach().clone()
    import torch.distributed as dist

    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local.detach().contiguous(), group=tp_group)
    full = torch.empty(t.shape, dtype=local.dtype, device=local.device)
    for rank, shard in enumerate(shards):
        pieces = shard.chunk(t.parts, dim=t.shard_dim)
        for (a, b), piece in zip(t.shard_ranges(rank, tp), pieces):
            full.narrow(t.shard_dim, a, b - a).copy_(piece)
    return full


def save_hf_checkpoint(shard, path: str | Path, hf_config: dict) -> None:
    """Write the replica in HF format under ``path``: one safetensors file per pipeline
    stage (``model-0000s-of-0000n.safetensors``) plus the index and ``config.json``
    (``hf_config`` with the model's numbers). Collective over the replica: every rank
    of it calls this; data-parallel rank 0 of each stage gathers and writes."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from realign.runtime.model import logical_shards

    g, spec = shard.groups, shard.spec
    pp = g.layout.pp
    out = Path(path)
    tensors = {t.name: t for t in stage_tensors(spec, shard.head, pp, g.pp_rank)}
    hf: dict[str, torch.Tensor] = {}
    for name, local in logical_shards(shard, g.layout, g.pp_rank).items():
        t = tensors[name]
        if name == "output_layer.weight" and t.content == "embedding":
            continue                         # tied: the first stage writes the embedding
        full = gather_full(t, local, g.pgs.tp, g.layout.tp)
        hf.update({k: v.cpu() for k, v in to_hf(t, full, spec).items()})
    # each EP rank holds its experts: the writer's EP group (TP rank 0, data-parallel
    # ranks 0 .. ep - 1) sends them to the writer, its EP rank 0, alone
    if g.ep > 1 and g.tp_rank == 0 and g.dp_rank < g.ep:
        parts: list | None = [None] * g.ep if g.ep_rank == 0 else None
        dist.gather_object(hf, parts, group=g.ep_group, group_dst=0)
        if parts is not None:
            hf = {k: v for part in parts for k, v in part.items()}
    fname = f"model-{g.pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    if g.dp_rank == 0 and g.tp_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(hf, str(out / fname), metadata={"format": "pt"})
    sizes: dict[int, dict[str, int]] = {}
    mine = ({k: v.numel() * v.element_size() for k, v in hf.items()}
            if g.dp_rank == 0 and g.tp_rank == 0 else {})
    # all_gather_object fills it with every rank's (pp_rank, mine)
    gathered: list[Any] = [None] * dist.get_world_size(g.model_group)
    dist.all_gather_object(gathered, (g.pp_rank, mine), group=g.model_group)
    for stage, stage_sizes in gathered:
        if stage_sizes:
            sizes[stage] = stage_sizes
    if g.tp_rank == 0 and g.dp_rank == 0 and g.pp_rank == 0:
        weight_map = {k: f"model-{s + 1:05d}-of-{pp:05d}.safetensors"
                      for s in range(pp) for k in sorted(sizes[s])}
        total = sum(n for s in range(pp) for n in sizes[s].values())
        (out / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        cfg = dict(hf_config)
        cfg.update(_config_numbers(spec, hf_config))
        # the tensors' own dtype (bf16 after a bf16 run), under both names transformers
        # has used for it
        dtype = str(next(iter(hf.values())).dtype).removeprefix("torch.") if hf else None
        if dtype:
            cfg.update(torch_dtype=dtype, dtype=dtype)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    dist.barrier(group=g.model_group)


def _config_numbers(spec: ModelSpec, hf_config: dict | None = None) -> dict:
    out: dict[str, Any] = {
        "num_hidden_layers": spec.n_layers, "hidden_size": spec.hidden,
        "num_attention_heads": spec.n_heads, "num_key_value_heads": spec.n_kv_heads,
        "intermediate_size": spec.ffn_hidden, "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tied_embeddings}
    if spec.moe is not None:
        # the experts' count under the key the source config used (transformers 5 writes
        # num_local_experts, the published configs num_experts)
        key = ("num_local_experts" if hf_config and "num_local_experts" in hf_config
               else "num_experts")
        out.update({key: spec.moe.n_experts, "num_experts_per_tok": spec.moe.top_k,
                    "moe_intermediate_size": spec.moe.expert_ffn_hidden,
                    "norm_topk_prob": spec.moe.norm_topk_prob,
                    "mlp_only_layers": list(spec.moe.dense_layers), "decoder_sparse_step": 1,
                    "router_aux_loss_coef": spec.moe.router_aux_loss_coef})
    return out
