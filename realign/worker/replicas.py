"""The model replicas a worker hosts: groups and shards, built from the program.

Every world rank walks the program's replica list in the same order (creating
process groups is collective over the world); members build their shard. Trained
copies and frozen models load the checkpoint; copies that reallocations fill are
built without weights and their storage is released until first use.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.specs.layout import Layout
from planner.specs.lora import LoraSpec
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec
from realign.realloc import offload
from realign.run.ops import Replica
from realign.run.program import Program
from realign.runtime.device import DeviceInfo
from realign.runtime.groups import ReplicaGroups, build_replica_groups
from realign.runtime.hf_checkpoint import HFReader, load_hf_weights
from realign.runtime.lora import attach_lora
from realign.runtime.lora_peft import load_peft_adapter
from realign.runtime.model import Head, ModelShard, build_model, check_te


@dataclass
class Hosted:
    replica: Replica
    groups: ReplicaGroups
    shard: ModelShard | None            #: None on ranks outside the replica's mesh
    released: offload.Released | None = None


def head_of(replica: Replica) -> Head:
    """The replica's output head: ``"lm"`` or ``"value"`` (the only ones a program names)."""
    if replica.head == "value":
        return "value"
    assert replica.head == "lm", f"{replica.key}: head {replica.head!r}"
    return "lm"


def build_replicas(program: Program, specs: dict[str, ModelSpec], paths: dict[str, str],
                   device: DeviceInfo, seed: int, use_te: bool = False,
                   loras: dict[str, LoraSpec] | None = None,
                   adapters: dict[str, str] | None = None) -> dict[str, Hosted]:
    """Every replica of the program (collective over the world); ``use_te``:
    Transformer-Engine's layer spec (``train.transformer_engine``); ``loras``: LoRA
    settings by role. A LoRA role's every copy loads the frozen base (a reallocation
    then moves only the adapters) and gets the same initial adapters; ``adapters``: a
    PEFT adapter folder by role to start from instead."""
    loras = loras or {}
    adapters = adapters or {}
    if use_te:
        check_te(device)
    readers: dict[str, HFReader] = {}
    out: dict[str, Hosted] = {}
    for r in program.replicas:
        spec = specs[r.role]
        groups = build_replica_groups(spec, DeviceMesh(first_gpu=r.first_gpu, n_gpus=r.n_gpus),
                                      Layout(tp=r.tp, pp=r.pp, dp=r.dp, ep=r.ep))
        shard = None
        released = None
        if groups.member:
            shard = build_model(spec, head_of(r), groups, device, seed=seed, init_weights=False,
                                use_te=use_te)
            lora = loras.get(r.role)
            if r.reallocated and lora is None:
                released = offload.release(shard.module.parameters())
            else:
                reader = readers.setdefault(r.role, HFReader(paths[r.role]))
                load_hf_weights(shard, paths[r.role], reader)
            if lora is not None:
                attach_lora(shard, lora, seed)
                if r.role in adapters:
                    load_peft_adapter(shard, adapters[r.role])
        out[r.key] = Hosted(r, groups, shard, released)
    return out
