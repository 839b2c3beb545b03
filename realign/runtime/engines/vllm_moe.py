"""A mixture of experts on vLLM's CPU build: its experts' weights after an in-memory
update put back into the layout its CPU kernel reads.

vLLM 0.32's CPU MoE experts (``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``,
``CPUUnquantizedExperts.process_weights_after_loading``) prepack ``w13_weight`` and
``w2_weight`` into the grouped GEMM's layout when the model is first loaded. On a
weight update (layerwise reload, or ``reload_weights`` from a folder) the checkpoint's
experts are loaded into those parameters in checkpoint layout, and the unquantized MoE
method skips the prepack (``fused_moe/unquantized_fused_moe_method.py``,
``_setup_kernel``: with ``moe_kernel`` already set, ``is_weight_update`` is true and
``fused_experts.process_weights_after_loading`` is not called), so the kernel reads
unpacked weights: a tiny Qwen3-MoE reloaded with its own checkpoint generated other
tokens than before. :func:`repack_cpu_experts` runs the prepack again, in place, after
every update realign makes (:mod:`realign.runtime.engines.vllm_worker_ext`). On CUDA
the experts' kernels read the checkpoint layout (the method's shuffle is copied into the
parameters on every update) and nothing is done.
"""
from __future__ import annotations

import torch


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Prepack, in place, the expert weights of every MoE layer of ``model`` whose
    kernel is vLLM's CPU unquantized one; the layers repacked (0 elsewhere)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    n = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        cfg = experts.moe_config
        if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
            raise ValueError(
                f"vLLM's CPU experts pad their intermediate size "
                f"{cfg.intermediate_size_per_partition} to "
                f"{experts._padded_intermediate_size(cfg)}: an in-memory weight update of "
                "such a model is not supported on CPU (realign run refuses it before "
                "starting: realign.run.vllm_check.cpu_moe_problem)")
        with torch.no_grad():
            for name in ("w13_weight", "w2_weight"):
                w = getattr(layer, name)
                w.data.copy_(ops.cpu_prepack_moe_weight(w.data, experts.isa))
        n += 1
    return n


def expert_shard(shard, name: str, local: dict[str, torch.Tensor], shape: tuple[int, ...]
                 ) -> torch.Tensor:
    """This rank's TP shard of logical tensor ``name`` for the weight update: its own
    (``local``), or, with expert parallelism, an expert another rank of its EP group
    holds, broadcast from that rank. vLLM's engine of each data-parallel rank holds
    every expert, so at EP > 1 each expert of a bucket goes from its owner to the rest
    of the EP group; every rank of the group calls this for the same tensors in the
    same order (:func:`realign.runtime.engines.vllm_weights.group_tensors`).
    ``shape``: the tensor's TP shard shape."""
    g = shard.groups
    if g.ep == 1 or ".mlp.experts.local_experts." not in name:
        return local[name].detach()
    import torch.distributed as dist

    from realign.runtime.ep_groups import expert_owner

    expert = int(name.split(".mlp.experts.local_experts.", 1)[1].split(".", 1)[0])
    assert shard.spec.moe is not None
    owner = expert_owner(expert, shard.spec.moe.n_experts, g.ep)
    if owner == g.ep_rank:
        buf = local[name].detach().contiguous()
    else:
        ref = next(iter(local.values()))
        buf = torch.empty(shape, dtype=ref.dtype, device=ref.device)
    dist.broadcast(buf, group_src=owner, group=g.ep_group)
    return buf


#: the most tokens (rows x width) :func:`rollout_routing_mismatch` scores in one forward:
#: its logits are [tokens, vocabulary] (about 2.5 GB in fp32 at a vocabulary of 152k)
SCORE_TOKENS = 4096


def row_chunks(rows: int, width: int, max_tokens: int = SCORE_TOKENS) -> list[range]:
    """``rows`` rows of ``width`` tokens in consecutive chunks of at most ``max_tokens``
    tokens (at least one row each).

    Example: 5 rows of 3 tokens, at most 6 -> [range(0, 2), range(2, 4), range(4, 5)]."""
    step = max(1, max_tokens // max(1, width))
    return [range(i, min(i + step, rows)) for i in range(0, rows, step)]


def rollout_routing_mismatch(shard, routing, prompts: list[list[int]], gen, pad_id: int,
                             max_tokens: int = SCORE_TOKENS) -> tuple[float, int]:
    """(share, tokens compared): the share of rollout tokens whose experts differ, at
    some sparse layer, between vLLM (``routing``: the engine's
    :class:`~realign.runtime.engines.vllm_routing.VLLMRouting` after the call, on the
    hosting rank; None elsewhere) and realign's forward of the replica that fed it, over
    the whole call (``moe.routing_mismatch``). Every rank of the replica calls it (the
    forward is collective over TP and EP): each data-parallel rank scores the sequences
    its engine generated, and the counts are summed over the data-parallel ranks (share
    0 when no token was compared). The share is scored in chunks of rows of at most
    ``max_tokens`` tokens (:func:`row_chunks`), so the forward's full-vocabulary logits
    stay bounded beside vLLM's KV cache; every rank makes as many chunks (their rows
    come from the whole call's longest sequence), as the forward's EP collectives need."""
    import torch.distributed as dist

    from realign.runtime.engines.decoder import StageDecoder
    from realign.runtime.moe import recording
    from realign.runtime.router_replay import routing_mismatch

    g = shard.groups
    per = len(prompts) // g.layout.dp
    first = g.dp_rank * per
    seqs = [q + gen.tokens[first + i, :int(gen.lengths[first + i])].tolist()
            for i, q in enumerate(prompts[first:first + per])]
    width = max(len(s) for s in seqs)
    # the whole call's longest sequence: the same chunks on every rank
    longest = max(len(q) + int(n) for q, n in zip(prompts, gen.lengths))
    dev = shard.device.device
    tokens = torch.full((per, width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s)
    decoder = StageDecoder(shard, max_len=width)
    counts = torch.zeros(2, dtype=torch.float64, device=dev)
    for rows in row_chunks(per, longest, max_tokens):
        with torch.no_grad(), recording(shard.module) as rec:
            decoder.score(tokens[rows.start:rows.stop].to(dev))
        trained = torch.stack(rec.experts, dim=2)        # [rows, width, layers, k]
        del rec
        if routing is not None:
            rolled = torch.full(trained.shape, -1, dtype=torch.long)
            for i in rows:
                r = routing.last[i]
                rolled[i - rows.start, :r.shape[0]] = r
            differ, compared = routing_mismatch(rolled, trained.cpu())
            counts += torch.tensor([differ, compared], dtype=torch.float64, device=dev)
    if g.layout.dp > 1:
        dist.all_reduce(counts, group=g.pgs.dp)
    if g.layout.tp > 1:      # the host's counts to its TP ranks
        dist.all_reduce(counts, group=g.pgs.tp)
    return (float(counts[0] / counts[1]) if counts[1] > 0 else 0.0), int(counts[1])


def gathered_routing(shard, routing, prompts: list[list[int]], gen, width: int
                     ) -> torch.Tensor:
    """The experts vLLM routed every token of the call to, on every rank of the replica:
    [sequences, ``width``, sparse layers, top_k] (int32; -1 where vLLM ran no forward
    (each sequence's last token) and past each sequence's length), rows in the call's
    order, positions as the sequences record's tokens (prompt, then response).
    ``routing``: the engine's :class:`~realign.runtime.engines.vllm_routing.VLLMRouting`
    after the call on the hosting rank of each data-parallel rank (None elsewhere);
    ``width``: the sequences record's. Every rank of the replica calls it: the host sends
    its rows over TP, then the data-parallel ranks' rows are gathered."""
    import torch.distributed as dist

    from realign.runtime.engines.base import gather_dp

    g = shard.groups
    moe = shard.spec.moe
    assert moe is not None, "a mixture of experts"
    per = len(prompts) // g.layout.dp
    local = torch.full((per, width, shard.spec.sparse_layers(), moe.top_k), -1,
                       dtype=torch.int32)
    if routing is not None:
        for i, r in enumerate(routing.last):
            n = min(width, r.shape[0])
            local[i, :n] = r[:n].to(torch.int32)
    local = local.to(shard.device.device)
    if g.layout.tp > 1:
        dist.broadcast(local, src=g.world_rank(0, g.dp_rank, g.pp_rank), group=g.pgs.tp)
    return gather_dp(shard, local).cpu()
