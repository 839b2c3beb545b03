"""Human and machine summaries of an :class:`ExecutionPlan` (table and JSON)."""
from __future__ import annotations

import math
from typing import Any

from planner.graph.lengths import expected_call_tokens
from planner.graph.packing import budget_shape, packed_shape, row_moments
from planner.graph.padding import rollout_moments
from planner.graph.refill import refill_shape
from planner.plan import ExecutionPlan

GIB = 2 ** 30


def summary(plan: ExecutionPlan) -> dict[str, Any]:
    """The ``realign plan --json`` object."""
    heur = {h.name: h.iteration_time_s for h in plan.heuristics}
    return {
        "name": plan.name,
        "cluster": plan.cluster.describe(),
        "iteration_time_s": plan.iteration_time_s,
        "search_time_s": plan.search.search_time_s,
        "method": plan.search.method,
        "heuristics": heur,
        "speedup": {n: (t / plan.iteration_time_s if t else None) for n, t in heur.items()},
        "mem_limit_bytes": plan.mem_limit_bytes,
        "mfcs": [
            {"name": a.mfc, "mesh": a.mesh_name, "first_gpu": a.mesh.first_gpu,
             "n_gpus": a.mesh.n_gpus, "tp": a.layout.tp, "pp": a.layout.pp, "dp": a.layout.dp,
             "ep": a.layout.ep,
             "micro_batches": a.micro_batches, "token_budget": a.token_budget,
             "time_s": a.time_s, "mem_bytes": a.mem_bytes,
             "optimizer_offload": a.optimizer_offload,
             "train_state_offload": a.train_state_offload, "host_bytes": a.host_bytes,
             "activation_recompute": a.activation_recompute,
             "engine": a.engine if a.kind == "generate" else None,
             "role": a.role, "adapters_off": plan.graph.mfc(a.mfc).adapters_off}
            for a in plan.allocations],
        "profile": plan.profile.model_dump() if plan.profile else None,
        "cost_sources": plan.cost_sources,
        "reallocations": [
            {"role": r.role, "to": r.to_mfc, "bytes": r.bytes, "time_s": r.time_s}
            for r in plan.reallocations],
        "lora": {m.role: {**m.lora.model_dump(mode="json"),
                          "trained_params": m.lora.total_params(m.spec),
                          "params": m.spec.total_params(m.head)}
                 for m in plan.models if m.lora is not None},
        "asynchronous": plan.asynchronous,
        "max_staleness": plan.graph.max_staleness,
        "modes": [m.model_dump() for m in plan.modes],
        "async_speedup": async_speedup(plan),
        "stream_speedup": stream_speedup(plan),
        "streaming": plan.streaming.model_dump() if plan.streaming else None,
        "lengths": priced_lengths(plan),
    }


def async_speedup(plan: ExecutionPlan) -> float | None:
    """Best synchronous over best asynchronous estimated iteration time (None unless
    both were planned and fit)."""
    t = {m.mode: m.iteration_time_s for m in plan.modes}
    sync, asyn = t.get("synchronous"), t.get("asynchronous")
    return sync / asyn if sync and asyn else None


def modes_lines(plan: ExecutionPlan) -> list[str]:
    """The best plan of each mode side by side (estimate, split, staleness, idle shares,
    allocations), with the speed-ups."""
    if not plan.modes:
        return []
    names = list(max(plan.modes, key=lambda m: len(m.allocations)).allocations)
    rows = [("", *(f"{m.mode}{' (chosen)' if m.chosen else ''}" for m in plan.modes))]
    rows.append(("iteration s", *(f"{m.iteration_time_s:.3f}" if m.iteration_time_s is not None
                                   else "does not fit" for m in plan.modes)))
    if any(m.slower_side_s > 0 for m in plan.modes):
        rows.append(("slower side per step", *(f"+{m.slower_side_s:.3f} s"
                                               if m.slower_side_s > 0 else "-"
                                               for m in plan.modes)))
    n = plan.cluster.n_gpus
    streams = any(m.mode == "streaming" for m in plan.modes)
    if streams:
        rows.append(("split gen+train GPUs", *(
            f"{m.gen_gpus}+{n - m.gen_gpus}" if m.gen_gpus is not None
            else ("shared" if m.iteration_time_s is not None else "-") for m in plan.modes)))
        rows.append(("staleness mean", *(f"{m.staleness_mean:.2f}"
                                         if m.iteration_time_s is not None else "-"
                                         for m in plan.modes)))
        for label, key in (("gen idle", "gen_idle_share"), ("train idle", "train_idle_share")):
            rows.append((label, *(f"{100 * v:.1f} %" if (v := getattr(m, key)) is not None
                                  else "-" for m in plan.modes)))
    for name in names:
        rows.append((name, *(m.allocations.get(name, "-") for m in plan.modes)))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    title = ("synchronous vs asynchronous vs streaming" if streams
             else "synchronous vs asynchronous")
    out = ["", f"{title} (algorithm.max_staleness {plan.graph.max_staleness}: generation "
               "ahead, on its own GPUs):"]
    out += ["  " + "  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    sp = async_speedup(plan)
    running = ("streaming" if plan.streaming is not None else
               "asynchronous" if plan.asynchronous else "synchronous")
    if sp is not None:
        out.append(f"  asynchronous speed-up: {sp:.2f}x (estimated); running the "
                   f"{running} plan")
    ss = stream_speedup(plan)
    if ss is not None:
        out.append(f"  streaming speed-up: {ss:.2f}x over synchronous (estimated)")
    fits = [m for m in plan.modes if m.iteration_time_s is not None]
    fastest = min(fits, key=lambda m: m.iteration_time_s or 0.0, default=None)
    if fastest is not None and not fastest.chosen and plan.streaming is not None:
        out.append(f"  the {fastest.mode} plan is estimated faster; rollout.mode: step "
                   "runs it")
    st = plan.streaming
    if st is not None:
        out.append(f"  stream: {st.slots} slots, staleness bound {st.max_staleness}, buffer "
                   f"{st.capacity_groups} groups of {st.group_size}, a step "
                   f"{st.train_iters} and a weights' copy {st.update_iters} decode "
                   f"iterations of {st.iter_s * 1e3:.2f} ms; {st.samples_per_s:.1f} "
                   f"samples/s, {100 * st.dropped_share:.1f} % of groups dropped as stale")
    return out


def stream_speedup(plan: ExecutionPlan) -> float | None:
    """Best synchronous over best streaming estimated iteration time (None unless both
    were planned and fit)."""
    t = {m.mode: m.iteration_time_s for m in plan.modes}
    sync, st = t.get("synchronous"), t.get("streaming")
    return sync / st if sync and st else None


def lora_lines(plan: ExecutionPlan) -> list[str]:
    """One line per LoRA model: its adapters, their share of the model, what that changes."""
    out = []
    for m in plan.models:
        if m.lora is None:
            continue
        n, total = m.lora.total_params(m.spec), m.spec.total_params(m.head)
        out.append(f"{m.role}: LoRA rank {m.lora.rank} (scale {m.lora.scale:g}) on "
                   f"{', '.join(m.lora.target_modules)}"
                   f"{' (one A per fused layer)' if m.lora.shared_a else ''}: "
                   f"{n / 1e6:.1f}M adapter parameters "
                   f"({100 * n / total:.2f} % of {total / 1e9:.2f}B) carry the gradients and "
                   "optimizer state; reallocations move only them")
        base = [a.mfc for a in plan.allocations
                if a.role == m.role and plan.graph.mfc(a.mfc).adapters_off]
        if base:
            out.append(f"{m.role}: one frozen base; {', '.join(base)} runs it with the "
                       f"adapters off (lora.{m.role}.share_base), on "
                       + ", ".join(f"{a.mesh_name} {a.layout}" for a in plan.allocations
                                   if a.mfc in base)
                       + ": no second copy, no reallocation")
    return out


def sources_line(plan: ExecutionPlan) -> str:
    """Which rates were read from a profile (marked *) and which from a device preset."""
    if plan.profile is None:
        return f"rates: device preset {plan.cluster.device.name} (no profile)"
    prof = sorted(k for k, v in plan.cost_sources.items() if v == "profile")
    rest = sorted(k for k, v in plan.cost_sources.items() if v.startswith("device preset"))
    other = sorted(f"{k} {v}" for k, v in plan.cost_sources.items()
                   if v != "profile" and not v.startswith("device preset"))
    return (f"rates: * from profile {plan.profile.path or '(unnamed)'} ({plan.profile.device}, "
            f"{plan.profile.dtype}, {plan.profile.date}): {', '.join(prof) or 'none'}"
            + (f"; device preset: {', '.join(rest)}" if rest else "")
            + (f"; {', '.join(other)}" if other else ""))


def host_line(plan: ExecutionPlan) -> str | None:
    """The host work outside the calls that the estimate includes (None: none)."""
    c = plan.cost_config
    if not (plan.step_overhead_s or c.reward_s_per_seq):
        return None
    batches = "2 batches" if plan.asynchronous else "its batch"
    out = (f"host work: {plan.step_overhead_s * 1e3:.2f} ms between steps (realign's own, "
           f"each worker preparing {batches} of {(c.batch_s or 0.0) * 1e3:.2f} ms)")
    if c.reward_s_per_seq and plan.graph.rule_rewards:
        out += (f"; the reward function {c.reward_s_per_seq * 1e6:.1f} us per sequence, "
                "after the generation")
    return out


def priced_lengths(plan: ExecutionPlan) -> dict[str, Any] | None:
    """The lengths the rollout is priced at (None: every prompt and response at its
    cap): mean prompt and response, and the mean length its rows are padded to."""
    gen = next((m for m in plan.graph.mfcs if m.kind == "generate"
                and m.input_keys[0] == "prompts"), None)
    if gen is None or (gen.lengths is None and gen.prompt_lengths is None):
        return None
    return {"prompt_mean": gen.prompt_lengths.expected() if gen.prompt_lengths else gen.prompt_len,
            "prompt_cap": gen.prompt_len,
            "response_mean": gen.lengths.expected() if gen.lengths else gen.gen_len,
            "response_cap": gen.gen_len, "rows": gen.n_seqs,
            "padded_mean": rollout_moments(gen)[0],
            "packed": any(m.packed for m in plan.graph.mfcs), "row_mean": row_moments(gen)[0],
            "bin_tokens": bin_tokens(plan), "generation": _steps_dict(plan)}


def _steps_dict(plan: ExecutionPlan) -> dict[str, Any] | None:
    """:func:`generation_steps` as a JSON object (None: no rollout on the own engine)."""
    steps = generation_steps(plan)
    if steps is None:
        return None
    return {"call": steps[0], "refill": steps[1], "decode_steps": steps[2],
            "wave_steps": steps[3]}


def bin_tokens(plan: ExecutionPlan) -> dict[str, float]:
    """Each packed call's priced tokens per micro-batch (a bin), by call name
    (:func:`planner.graph.packing.packed_shape` under its allocation, or
    :func:`~planner.graph.packing.budget_shape` under its token budget)."""
    mfcs = {m.name: m for m in plan.graph.mfcs}
    out = {}
    for a in plan.allocations:
        m = mfcs[a.mfc]
        per_step = m.n_seqs / (m.n_minibatches if m.kind == "train" else 1)
        if m.packed and a.token_budget is not None:
            out[a.mfc] = budget_shape(m, per_step / a.layout.dp, a.token_budget)[1]
        elif m.packed:
            rows = per_step / a.layout.dp / a.micro_batches
            out[a.mfc] = packed_shape(m, rows, a.micro_batches, a.layout.dp)[0]
    return out


def generation_steps(plan: ExecutionPlan) -> tuple[str, bool, float, float] | None:
    """(call, whether it refills, expected decode steps, those of waves) of the
    rollout's generate call on
    realign's own engine, per slot group or group of waves of its slowest DP rank (None:
    no such call)."""
    gen = next((m for m in plan.graph.mfcs if m.kind == "generate"
                and m.input_keys[0] == "prompts" and m.turns is None), None)
    a = next((a for a in plan.allocations if gen is not None and a.mfc == gen.name), None)
    if gen is None or a is None or a.engine != "own":
        return None
    n_local, m, pp, dp = gen.n_seqs // a.layout.dp, a.micro_batches, a.layout.pp, a.layout.dp
    g = min(m, pp, n_local)
    groups = math.ceil(m / g)
    waves = groups * max(expected_call_tokens(gen, n_local / m, groups, dp) - 1.0, 0.0)
    refill = refill_shape(gen, math.ceil(n_local / m), math.ceil(n_local / g), dp)[0]
    return gen.name, gen.refill, (refill if gen.refill else waves), waves


def lengths_line(plan: ExecutionPlan) -> str | None:
    """How long the rollout's prompts, responses and padded rows are priced (None: at
    the caps), and the decode steps of its generation."""
    x = priced_lengths(plan)
    if x is None:
        return None
    steps = generation_steps(plan)
    if steps is not None and steps[1]:
        tail = (f"; {steps[0]} refills its slots: {steps[2]:.0f} decode steps expected, "
                f"where waves would take {steps[3]:.0f}")
    elif steps is not None:
        tail = f"; {steps[0]} in waves: {steps[2]:.0f} decode steps expected"
    else:
        tail = ""
    return _lengths_head(x) + tail


def _lengths_head(x: dict[str, Any]) -> str:
    """:func:`lengths_line` but its generation: prompts, responses, padded or packed rows."""
    head = (f"lengths: prompts {x['prompt_mean']:.1f} tokens on average (cap "
            f"{x['prompt_cap']}), responses {x['response_mean']:.1f} (cap {x['response_cap']}); ")
    if x["packed"]:
        bins = ", ".join(f"{k} {v:.0f}" for k, v in x["bin_tokens"].items())
        return head + (f"a step's {x['rows']} rows packed at {x['row_mean']:.1f} tokens each "
                       "on average (plus each bin's rounding), where scoring and training "
                       f"are priced (padded to the longest: {x['padded_mean']:.1f}); tokens "
                       f"per micro-batch: {bins}")
    return head + (f"a step's {x['rows']} rows padded to {x['padded_mean']:.1f} on average, "
                   "where scoring and training are priced")


def turns_lines(plan: ExecutionPlan) -> list[str]:
    """One line per multi-turn generate call: its priced episode shape and its time per
    turn (:mod:`planner.graph.turns`)."""
    out = []
    for a in plan.allocations:
        t = plan.graph.mfc(a.mfc).turns if a.kind == "generate" else None
        if t is None:
            continue
        out.append(f"{a.mfc}: {t.turns:.3g} turns of <= {t.turn_tokens} tokens, "
                   f"{t.obs_tokens}-token observations, {t.env_s:.3g} s environment per turn, "
                   f"{t.groups} group(s) taking turns: {a.time_s / t.turns:.3f} s per turn")
    return out


def table(plan: ExecutionPlan) -> str:
    """The plan as text. ``*`` marks estimates priced with a profile's rates, ``+off``
    a train call whose optimizer state is offloaded to host memory (Adam stepped there),
    ``+state`` one whose gradients and GPU optimizer state exist only during the call,
    ``+rc`` one that recomputes each layer's activations in the backward; a packed
    scoring call's micro-batches are its expected bins, with its token budget; ``EPn``
    beside DP: the experts split over n of the data-parallel ranks."""
    mark = "*" if plan.profile is not None else ""
    rows = [("MFC", "mesh", "GPUs", "TP", "PP", "DP", "micro", "engine", "time s",
             "mem GiB/GPU")]
    for a in plan.allocations:
        rows.append((a.mfc + (f" ({a.role} base)" if plan.graph.mfc(a.mfc).adapters_off else "")
                     + (" +off" if a.optimizer_offload else "")
                     + (" +state" if a.train_state_offload else "")
                     + (" +rc" if a.activation_recompute else ""), a.mesh_name,
                     str(a.mesh.n_gpus), str(a.layout.tp), str(a.layout.pp),
                     str(a.layout.dp) + (f" EP{a.layout.ep}" if a.layout.ep > 1 else ""),
                     str(a.micro_batches) + (
                         f" (budget {a.token_budget} tok)" if a.token_budget else ""),
                     a.engine if a.kind == "generate" else "-", f"{a.time_s:.3f}{mark}",
                     f"{a.mem_bytes / GIB:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 or i == 7 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = [f"{plan.name} on {plan.cluster.describe()} "
           f"({plan.mem_limit_bytes / GIB:.1f} GiB usable per GPU)", ""] + lines
    for r in plan.reallocations:
        out.append(f"realloc {r.role} -> {r.to_mfc}: {r.bytes / GIB:.2f} GiB in {r.time_s:.3f} s "
                   f"({r.src_layout} -> {r.dst_layout})")
    out += lora_lines(plan)
    for a in plan.allocations:
        if a.optimizer_offload or a.train_state_offload:
            what = " and ".join(w for w, on in (
                ("optimizer state offloaded (Adam on the host)", a.optimizer_offload),
                ("training state on the host between calls", a.train_state_offload)) if on)
            out.append(f"{a.mfc}: {what}, {a.host_bytes / GIB:.1f} GiB of host memory per GPU")
    if any(a.engine == "vllm" for a in plan.allocations):
        lora = any(m.lora is not None and m.role == "actor" for m in plan.models)
        moved = ("the actor's LoRA adapters (its base loaded once, at start)" if lora
                 else "its weights")
        out.append("engine vllm: continuous batching on one vLLM engine per GPU, "
                   f"{moved} copied from the trained model before each call (docs/vllm.md)")
    out.extend(turns_lines(plan))
    out.append(sources_line(plan))
    for line in (host_line(plan), lengths_line(plan)):
        if line:
            out.append(line)
    out.append("")
    out.append(f"estimated iteration time: {plan.iteration_time_s:.3f} s   "
               f"(search: {plan.search.method}, {plan.search.search_time_s:.1f} s, "
               f"{plan.search.steps} steps, space {plan.search.space_size:.3g})")
    for h in plan.heuristics:
        if not h.evaluated:
            out.append(f"  {h.name:15s} not evaluated within plan.time_limit_s")
        elif h.not_applicable:
            out.append(f"  {h.name:15s} does not apply: {h.not_applicable}")
        elif h.iteration_time_s is None:
            out.append(f"  {h.name:15s} does not fit in memory")
        else:
            out.append(f"  {h.name:15s} {h.iteration_time_s:9.3f} s   searched plan is "
                       f"{h.iteration_time_s / plan.iteration_time_s:.2f}x faster")
    out += modes_lines(plan)
    return "\n".join(out)
