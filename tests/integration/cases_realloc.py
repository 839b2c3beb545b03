"""Rank-side body of the train -> reallocate -> generate test (runs in a
:class:`realign.runtime.local_world.LocalWorld`; importable by name in the workers)."""
from __future__ import annotations

import dataclasses

import torch

from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from realign.realloc import offload
from realign.runtime.device import init_device
from realign.runtime.engines.generate import GenerateEngine
from realign.runtime.engines.train import TrainConfig, TrainEngine
from realign.runtime.groups import build_replica_groups
from realign.runtime.hf_checkpoint import HFReader, load_hf_weights, spec_from_hf
from realign.runtime.model import build_model
from realign.runtime.realloc_glue import reallocate_replica, release_copy, shard_tensors
from realign.runtime.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12], [150, 1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67]]
GREEDY = SamplingParams(max_new_tokens=8, greedy=True)
# a large Adam epsilon keeps the update of near-zero gradients small (see cases_train)
TRAIN = TrainConfig(lr=1e-2, adam_eps=1e-4, clip_grad=1.0)


def sft_loss(outputs, mb):
    """Mean negative log-likelihood of the valid next tokens."""
    s = mb["tokens"].shape[1]
    valid = (torch.arange(1, s) < mb["lengths"].unsqueeze(1)).float()
    return -(outputs * valid).sum() / valid.sum(), {}


def batch():
    g = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, 200, (4, 12), generator=g),
            "lengths": torch.tensor([12, 9, 7, 2])}


def _replica(spec, path, reader, dev, place, load: bool):
    """Groups (collective: every rank) and, on members, the model shard."""
    first, tp, pp, dp = place
    groups = build_replica_groups(spec, DeviceMesh(first_gpu=first, n_gpus=tp * pp * dp),
                                  Layout(tp=tp, pp=pp, dp=dp))
    if not groups.member:
        return groups, None
    shard = build_model(spec, "lm", groups, dev, init_weights=False)
    if load:
        load_hf_weights(shard, path, reader)
    return groups, shard


def _generate(shard):
    if shard is None:
        return None
    out = GenerateEngine(shard).generate(PROMPTS, GREEDY)
    return out.tokens.tolist(), out.logprobs.tolist(), out.lengths.tolist()


def _poison(shard) -> None:
    """NaN into every destination parameter: a slice the reallocation misses shows."""
    for t in (shard_tensors(shard) or {}).values():
        t.fill_(float("nan"))


def train_realloc_generate(ctx, path, a, b, gpus_per_node):
    """Replica A (``a`` = (first, tp, pp, dp)) trains a step; it is reallocated into
    replica B (``b``), which generates; B's copy is released; A trains a second step
    (compared with a control replica that never took part in a reallocation); B is
    restored, refilled and generates again. Every replica lives in the same processes."""
    dev = init_device("cpu")
    spec, reader = spec_from_hf(path), HFReader(path)
    ctrl_g, ctrl = _replica(spec, path, reader, dev, a, load=True)
    a_g, rep_a = _replica(spec, path, reader, dev, a, load=True)
    b_g, rep_b = _replica(spec, path, reader, dev, b, load=False)
    data = batch()
    out = {"in_a": rep_a is not None, "in_b": rep_b is not None}

    def realloc():
        _poison(rep_b)
        s = reallocate_replica(spec, "lm", a_g, b_g, rep_a, rep_b, dtype=dev.dtype,
                               gpus_per_node=gpus_per_node)
        return dataclasses.astuple(s)

    if rep_a is not None:
        eng_ctrl, eng_a = TrainEngine(ctrl, TRAIN), TrainEngine(rep_a, TRAIN)
        out["ctrl_hist"] = [eng_ctrl.train_step(data, sft_loss) for _ in range(2)]
        out["a_hist"] = [eng_a.train_step(data, sft_loss)]
        out["gen_a1"] = _generate(rep_a)
    out["stats1"] = realloc()
    out["gen_b1"] = _generate(rep_b)

    if rep_b is not None:
        out["b_param_bytes"] = sum(p.untyped_storage().nbytes() for p in rep_b.module.parameters())
    released = release_copy(rep_b)
    if rep_b is not None:
        out["freed_bytes"] = released.total_bytes
        out["b_bytes_after_release"] = sum(p.untyped_storage().nbytes()
                                           for p in rep_b.module.parameters())

    if rep_a is not None:
        out["a_hist"].append(eng_a.train_step(data, sft_loss))
        ours = dict(rep_a.module.named_parameters())
        out["a_vs_ctrl"] = max(float((ours[n] - p).detach().abs().max())
                               for n, p in ctrl.module.named_parameters())
        out["gen_a2"] = _generate(rep_a)
    if rep_b is not None:
        offload.restore(released)
    out["stats2"] = realloc()
    out["gen_b2"] = _generate(rep_b)
    release_copy(rep_b)
    return out
