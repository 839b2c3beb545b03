"""LoRA adapters in and out in PEFT's format, and a merged checkpoint.

PEFT's folder: ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``target_modules`` by Hugging Face names...) and ``adapter_model.safetensors`` with
``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r] per adapted module (PEFT loads it with
``PeftModel.from_pretrained(base, folder)``).

megatron fuses q/k/v (and gate/up) into one layer; realign's adapter on it is PEFT's
adapters of the adapted parts (:mod:`planner.specs.lora`): written out, part ``p`` gets
block ``p`` of the fused ``A`` and its own rows of ``B`` (un-interleaving megatron's
query-group-major rows as the base weight's export does); read in, the parts' ``A`` are
stacked and their ``B`` interleaved again. So any PEFT LoRA adapter of a supported
family loads, whichever projections it adapts. With ``shared_a`` the fused ``A`` is
written to every part, and an adapter whose fused parts have different ``A`` is refused
(:func:`check_peft_adapter`, exit 2).

A value head (critic, reward model) is trained whole: written as PEFT's
``modules_to_save`` (``score``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from planner.specs.lora import COLUMN, HF_NAMES, HF_TARGETS, MODULE_OF, LoraSpec, part_rows
from planner.specs.model_spec import ModelSpec
from planner.specs.param_layout import LogicalTensor, layer_tensors
from realign.errors import UserError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
#: megatron target -> the logical tensor kind of its base weight
KIND = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "fc1", "linear_fc2": "fc2"}
HF_MODULE = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp",
             "linear_fc2": "mlp"}


def base_tensor(spec: ModelSpec, layer: int, target: str) -> LogicalTensor:
    """The logical base weight a target adapts (its rows give B's layout)."""
    want = f"decoder.layers.{layer}.{MODULE_OF[target]}.{target}.weight"
    return next(t for t in layer_tensors(spec, layer) if t.name == want)


def hf_key(layer: int, name: str, factor: str) -> str:
    """PEFT's key of one factor (``A`` or ``B``) of a Hugging Face module (``q_proj``)."""
    return (f"{PREFIX}model.layers.{layer}.{HF_MODULE[HF_TARGETS[name]]}.{name}"
            f".lora_{factor}.weight")


def b_to_hf(spec: ModelSpec, lora: LoraSpec, target: str, full_b: torch.Tensor
            ) -> list[torch.Tensor]:
    """A full ``B`` in megatron's row order -> the adapted parts' ``B`` (in
    ``lora.parts(target)`` order)."""
    groups, rows = part_rows(spec, target)
    sizes = [n for name, n in zip(HF_NAMES[target], rows) if name in lora.parts(target)]
    r = full_b.shape[1]
    blocks = full_b.reshape(groups, -1, r).split(sizes, dim=1)
    return [b.reshape(-1, r).contiguous() for b in blocks]


def b_from_hf(spec: ModelSpec, target: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The adapted parts' ``B`` (in megatron's part order) -> one full ``B`` in
    megatron's row order (query-group-major for q/k/v)."""
    groups, _rows = part_rows(spec, target)
    r = parts[0].shape[1]
    return torch.cat([p.reshape(groups, -1, r) for p in parts], dim=1).reshape(-1, r)


def a_to_hf(lora: LoraSpec, target: str, full_a: torch.Tensor) -> list[torch.Tensor]:
    """A full ``A`` -> the adapted parts' ``A`` (each its block; the one ``A`` to every
    part with ``shared_a``)."""
    n = len(lora.parts(target))
    if lora.shared_a:
        return [full_a.clone() for _ in range(n)]       # one file entry each
    return [a.contiguous() for a in full_a.split(lora.rank)]


def a_from_hf(lora: LoraSpec, parts: list[torch.Tensor]) -> torch.Tensor:
    """The adapted parts' ``A`` -> the fused ``A`` (the first with ``shared_a``, whose
    parts :func:`check_peft_adapter` found equal)."""
    return parts[0] if lora.shared_a else torch.cat(parts)


# ---- out ----------------------------------------------------------------------------

def full_adapters(shard) -> dict[str, torch.Tensor]:
    """This stage's adapters (and value head) gathered over TP, in PEFT's keys and
    layout (every rank of the stage gets them)."""
    from planner.specs.lora import trained_stage_tensors
    from realign.runtime.hf_checkpoint import gather_full
    from realign.runtime.model import logical_shards

    g, spec, lora = shard.groups, shard.spec, shard.lora
    tensors = {t.name: t for t in trained_stage_tensors(spec, shard.head, lora, g.layout.pp,
                                                        g.pp_rank)}
    local = logical_shards(shard, g.layout, g.pp_rank, moved=True)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        full = gather_full(t, local[name], g.pgs.tp, g.layout.tp).cpu().contiguous()
        if t.content == "value_head":
            out[f"{PREFIX}score.weight"] = full
            continue
        assert t.layer is not None, name        # the value head is the one layer-less tensor
        target, factor = name.split(".")[-2], name.split(".")[-1][-1]
        parts = a_to_hf(lora, target, full) if factor == "A" else b_to_hf(spec, lora, target,
                                                                           full)
        for hf_name, part in zip(lora.parts(target), parts):
            out[hf_key(t.layer, hf_name, factor)] = part
    return out


def peft_config(lora: LoraSpec, head: str, base_path: str) -> dict:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM" if head == "lm" else "SEQ_CLS",
        "base_model_name_or_path": str(base_path), "r": lora.rank,
        "lora_alpha": lora.alpha if lora.alpha is not None else lora.rank,
        "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted(lora.target_modules),
        "modules_to_save": ["score"] if head == "value" else None,
        "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
        "use_dora": False, "layers_to_transform": None, "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft_adapter(shard, folder: str | Path, base_path: str) -> None:
    """Write the replica's adapters as a PEFT adapter folder. Collective over the
    replica's model group; the replica's first rank writes."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    g = shard.groups
    full = full_adapters(shard)          # collective over TP: every rank gathers
    mine = full if g.tp_rank == 0 and g.dp_rank == 0 else {}
    gathered: list = [None] * dist.get_world_size(g.model_group)
    dist.all_gather_object(gathered, mine, group=g.model_group)
    if g.tp_rank == 0 and g.dp_rank == 0 and g.pp_rank == 0:
        tensors: dict[str, torch.Tensor] = {}
        for part in gathered:
            tensors.update(part)
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
        (out / CONFIG).write_text(json.dumps(peft_config(shard.lora, shard.head, base_path),
                                             indent=2))
    dist.barrier(group=g.model_group)


def save_merged_checkpoint(shard, folder: str | Path, hf_config: dict) -> None:
    """Write the replica with ``W + scale * B A`` in every adapted weight as a full HF
    checkpoint (collective, like :func:`realign.runtime.hf_checkpoint.save_hf_checkpoint`).
    Each TP rank merges its own slice (a column-parallel layer's rows, a row-parallel
    layer's columns); the base weights are restored afterwards."""
    from realign.runtime.hf_checkpoint import save_hf_checkpoint
    from realign.runtime.lora import adapted, adapter, delta_weight

    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for layer in shard.module.decoder.layers:
            for mod in adapted(layer).values():
                w = adapter(mod).weight
                kept.append((w, w.detach().clone()))
                w.add_(delta_weight(mod).to(w.dtype))
        try:
            save_hf_checkpoint(shard, folder, hf_config)
        finally:
            for w, orig in kept:
                w.copy_(orig)


# ---- in -----------------------------------------------------------------------------

def read_peft_adapter(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    p = Path(folder)
    return json.loads((p / CONFIG).read_text()), load_file(str(p / WEIGHTS))


#: PEFT settings realign's adapters cannot express -> the value they must have
PLAIN_LORA = {"use_dora": False, "use_rslora": False, "bias": "none", "lora_bias": False,
              "fan_in_fan_out": False, "layers_to_transform": None, "rank_pattern": {},
              "alpha_pattern": {}, "trainable_token_indices": None,
              "target_parameters": None, "layer_replication": None, "use_qalora": False}


def adapted_modules(tensors: dict[str, torch.Tensor]) -> set[str]:
    """The Hugging Face projection names that carry a ``lora_A`` somewhere in a PEFT
    adapter's tensors (what it adapts, whatever its config's patterns)."""
    return {key.split(".")[-3] for key in tensors if key.endswith(".lora_A.weight")}


def check_peft_adapter(folder: str | Path, spec: ModelSpec, head: str, lora: LoraSpec,
                       field: str) -> None:
    """:class:`UserError` naming ``field`` unless the PEFT adapter at ``folder`` fits
    this model and these settings: plain LoRA (no DoRA, rsLoRA, bias, per-module ranks
    or layer subset), the same rank and alpha, the same adapted projections, every
    tensor present with the shape the base implies, and with ``shared_a`` one ``A`` per
    fused layer. Reads files only (before any worker starts)."""
    p = Path(folder)
    if not (p / CONFIG).is_file() or not (p / WEIGHTS).is_file():
        raise UserError(f"{str(folder)!r} is not a PEFT adapter folder (needs {CONFIG} and "
                        f"{WEIGHTS})", field=field)
    cfg, tensors = read_peft_adapter(p)
    if cfg.get("peft_type") != "LORA":
        raise UserError(f"the adapter is {cfg.get('peft_type')!r}, not LORA", field=field)
    for key, plain in PLAIN_LORA.items():
        value = cfg.get(key)
        if not (value is None or value == plain or (not value and not plain)):
            raise UserError(f"the adapter has {key}={cfg.get(key)!r}; realign's LoRA runs "
                            f"plain LoRA ({key}={plain!r})", field=field)
    saved = set(cfg.get("modules_to_save") or []) - ({"score"} if head == "value" else set())
    if saved:
        raise UserError(f"the adapter also trains {sorted(saved)} whole (modules_to_save); "
                        "realign trains only the adapters (and a value model's score head)",
                        field=field)
    alpha = lora.alpha if lora.alpha is not None else lora.rank
    for key, mine, what in (("r", lora.rank, "rank"), ("lora_alpha", alpha, "alpha")):
        if cfg.get(key) != mine:
            raise UserError(f"the adapter has {key}={cfg.get(key)}, the settings' {what} is "
                            f"{mine}: set them alike", field=field)
    got, want = adapted_modules(tensors), set(lora.target_modules)
    if got != want:
        raise UserError(f"the adapter adapts {sorted(got)}, the settings {sorted(want)} "
                        "(target_modules): set them alike", field=field)
    from realign.runtime.hf_checkpoint import hf_shapes

    for layer in range(spec.n_layers):
        for target in lora.targets:
            base = base_tensor(spec, layer, target)
            k = base.shape[1]
            outs = dict(zip(HF_NAMES[target], (s[0] for s in hf_shapes(base, spec))))
            names = lora.parts(target)
            for name in names:
                for factor, shape in (("A", (lora.rank, k)), ("B", (outs[name], lora.rank))):
                    key = hf_key(layer, name, factor)
                    if key not in tensors:
                        raise UserError(f"the adapter lacks {key!r}: it was not made for this "
                                        f"{spec.n_layers}-layer model", field=field)
                    if tuple(tensors[key].shape) != shape:
                        raise UserError(f"{key!r} has shape {tuple(tensors[key].shape)}; this "
                                        f"base model implies {shape}: the adapter was made "
                                        "for another base", field=field)
            a0 = tensors[hf_key(layer, names[0], "A")]
            if lora.shared_a and any(not torch.equal(a0, tensors[hf_key(layer, n, "A")])
                                     for n in names[1:]):
                raise UserError(f"{', '.join(names)} of layer {layer} have different lora_A: "
                                f"with shared_a realign gives {target} one A, so it can "
                                "start only from an adapter whose fused parts share A; set "
                                "shared_a: false to load any PEFT adapter", field=field)
    if head == "value" and f"{PREFIX}score.weight" not in tensors:
        raise UserError("the adapter has no score head (modules_to_save) for this value "
                        "model", field=field)


def load_peft_adapter(shard, folder: str | Path) -> None:
    """Copy this rank's slices of a PEFT adapter (checked with
    :func:`check_peft_adapter`) into ``shard``'s adapters. No collectives."""
    from planner.specs.layout import stage_layers
    from realign.runtime.lora import adapted, adapter

    _cfg, tensors = read_peft_adapter(folder)
    g, spec, lora = shard.groups, shard.spec, shard.lora
    tp, tp_rank = g.layout.tp, g.tp_rank
    layers = stage_layers(spec.n_layers, g.layout.pp, g.pp_rank)
    with torch.no_grad():
        for local, layer in enumerate(shard.module.decoder.layers):
            glob = layers[local]
            b_tensor = {t.name.split(".")[-2]: t for t in lora.layer_tensors(spec, glob)
                        if t.name.endswith("lora_B")}
            for target, mod in adapted(layer).items():
                names = lora.parts(target)
                a = a_from_hf(lora, [tensors[hf_key(glob, n, "A")] for n in names])
                b = b_from_hf(spec, target, [tensors[hf_key(glob, n, "B")] for n in names])
                if target in COLUMN:
                    b = torch.cat([b[lo:hi] for lo, hi in
                                   b_tensor[target].shard_ranges(tp_rank, tp)])
                else:
                    k = a.shape[1]
                    a = a[:, tp_rank * k // tp:(tp_rank + 1) * k // tp]
                adapter(mod).lora_A.copy_(a)
                adapter(mod).lora_B.copy_(b)
        if shard.head == "value" and g.is_last_stage:
            shard.module.output_layer.weight.copy_(tensors[f"{PREFIX}score.weight"])
