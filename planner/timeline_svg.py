"""Timeline pictures: one lane per GPU group, a bar per call and per parameter
reallocation. :func:`render` draws a plan's simulated iterations (with the peak memory
per GPU group), or a streaming plan's two sides running continuously
(:func:`render_stream`); :func:`draw_lanes` is the drawing they and the run report's
measured timeline use.

GPU groups are the coarsest split of the cluster that every mesh of the plan is a
union of, so each lane is a set of GPUs that always work together.
"""
from __future__ import annotations

from dataclasses import dataclass
from html import escape

from planner.graph.stream_steady import (
    draw_stream_lengths,
    lengths_needed,
    scaled_schedule,
    sim_scale,
)
from planner.plan import ExecutionPlan
from planner.report import sources_line, turns_lines
from planner.svg import head, seconds

COLORS = {"generate": "#4e79a7", "inference": "#59a14f", "train": "#e15759",
          "realloc": "#f2a93b", "send": "#9d9d9d", "reward": "#b07aa1", "eval": "#76b7b2"}
GIB = 2 ** 30


@dataclass(frozen=True)
class Bar:
    """One bar of a timeline: a call, a reallocation, a transfer..."""

    name: str
    kind: str
    start_s: float
    end_s: float
    gpus: tuple[int, ...]
    note: str = ""           #: shown on hover


def gpu_groups(n_gpus: int, meshes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(first, last) GPU of each group: cut the GPU range at every mesh boundary.
    ``meshes``: (first GPU, GPU count) of each mesh."""
    cuts = {0, n_gpus}
    for first, n in meshes:
        cuts.update((first, first + n))
    pts = sorted(cuts)
    return [(pts[k], pts[k + 1] - 1) for k in range(len(pts) - 1)]


def draw_lanes(out: list[str], groups: list[tuple[int, int]], bars: list[Bar], end: float,
               left: int, top: int, width: int, lane_h: int = 34, gap: int = 8) -> int:
    """Append the lanes, their bars, the time axis and the legend of the kinds used to
    ``out``; returns the y below them."""
    sx = width / (end or 1.0)
    for k, (lo, hi) in enumerate(groups):
        y = top + k * (lane_h + gap)
        label = f"GPU {lo}" if lo == hi else f"GPUs {lo}-{hi}"
        out.append(f'<rect x="{left}" y="{y}" width="{width}" height="{lane_h}" fill="#f4f4f4"/>')
        out.append(f'<text x="{left - 8}" y="{y + lane_h / 2 + 4}" text-anchor="end">{label}</text>')
        for b in bars:
            if not any(lo <= g <= hi for g in b.gpus):
                continue
            x, w = left + b.start_s * sx, max((b.end_s - b.start_s) * sx, 1.0)
            out.append(f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{lane_h - 4}" '
                       f'fill="{COLORS.get(b.kind, "#999")}" stroke="white" stroke-width="0.5">'
                       f'<title>{escape(b.name)}{escape(b.note)}: '
                       f'{seconds(b.start_s, end)}-{seconds(b.end_s, end)}</title></rect>')
            # the whole name, else without its engine / turns suffix, where it fits
            fits = [n for n in ((b.name, b.name.split(" [")[0]) if b.kind != "realloc"
                                else ("realloc",)) if w > 7 * len(n)]
            if fits:
                out.append(f'<text x="{x + 3:.1f}" y="{y + lane_h / 2 + 4}" fill="white">'
                           f'{escape(fits[0])}</text>')
    ya = top + len(groups) * (lane_h + gap) + 6
    for k in range(6):
        t = end * k / 5
        out.append(f'<text x="{left + t * sx:.1f}" y="{ya + 10}" text-anchor="middle" '
                   f'fill="#555">{seconds(t, end)}</text>')
    lx = left
    for kind in dict.fromkeys(b.kind for b in bars):
        out.append(f'<rect x="{lx}" y="{ya + 24}" width="12" height="12" '
                   f'fill="{COLORS.get(kind, "#999")}"/>')
        out.append(f'<text x="{lx + 16}" y="{ya + 34}">{kind}</text>')
        lx += 100
    return ya + 44


def engine_labels(plan: ExecutionPlan) -> dict[str, str]:
    """Each generate call's engine as its bars' suffix: `` [vllm]`` or `` [own]``, and
    a multi-turn call's turns: `` [own, 2 turns]``."""
    out = {}
    for a in plan.allocations:
        if a.kind == "generate":
            t = plan.graph.mfc(a.mfc).turns
            out[a.mfc] = f" [{a.engine}" + (f", {t.turns:.3g} turns]" if t else "]")
    return out


#: training steps a streaming plan's picture shows (after the buffer has filled)
STREAM_STEPS_SHOWN = 4


def stream_bars(plan: ExecutionPlan) -> list[Bar]:
    """A streaming plan's schedule over :data:`STREAM_STEPS_SHOWN` steps of its steady
    state, simulated as the planner did: the generator decoding on its GPUs between the
    weights' copies (a copy where an update reaches it), the trainer training each batch
    from the iteration it takes it. Seconds from the first step shown."""
    st = plan.streaming
    assert st is not None
    first = next(m for m in plan.graph.mfcs if m.kind == "generate" and not m.is_eval)
    s = st.settings()
    q, f = sim_scale(s, first.gen_len)
    lengths = draw_stream_lengths(first.lengths, first.gen_len,
                                  lengths_needed(s, STREAM_STEPS_SHOWN), plan.search.seed)
    sch = scaled_schedule(s, lengths, q, f)
    warm = st.max_staleness + 2
    takes = [r.take_iter for r in sch.run_steps(warm + STREAM_STEPS_SHOWN)][warm - 1:]
    t0, unit = takes[0], q * st.iter_s
    gen = tuple(range(st.gen_gpus))
    train = tuple(range(st.gen_gpus, st.gen_gpus + st.train_gpus))
    train_s, copy_s = st.train_iters * st.iter_s, st.update_iters * st.iter_s
    bars: list[Bar] = []
    prev = 0.0
    for k, take in enumerate(takes[:-1]):
        start = (take - t0) * unit
        bars.append(Bar(f"actor.train step {k + 1}", "train", start, start + train_s, train))
        arrive = start + train_s
        bars.append(Bar("actor.generate", "generate", prev, arrive, gen))
        bars.append(Bar(f"weights v{k + 1}", "realloc", arrive, arrive + copy_s, gen + train))
        prev = arrive + copy_s
    end = (takes[-1] - t0) * unit
    if prev < end:
        bars.append(Bar("actor.generate", "generate", prev, end, gen))
    return bars


def render_stream(plan: ExecutionPlan) -> str:
    """A streaming plan: the generator's lane decoding continuously, the trainer's lane
    training batch after batch, a weights' copy (update mark) where each update reaches
    the generator, and the predicted steady state in the title."""
    st = plan.streaming
    assert st is not None
    bars = stream_bars(plan)
    groups = [(0, st.gen_gpus - 1), (st.gen_gpus, plan.cluster.n_gpus - 1)]
    end = max((b.end_s for b in bars), default=1.0) or 1.0
    left, lane_h, gap, width, top = 150, 34, 8, 900, 84
    gpus = "GPU 0" if st.gen_gpus == 1 else f"GPUs 0-{st.gen_gpus - 1}"
    out = [*head(left + width + 40, top + 2 * (lane_h + gap) + 70),
           f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(plan.name)}: '
           f'{seconds(st.step_s, st.step_s)} per step streaming on '
           f'{escape(plan.cluster.describe())}</text>',
           f'<text x="10" y="38" fill="#555">generation on {gpus} '
           f'({100 * st.gen_idle_share:.1f} % idle), training on the other {st.train_gpus} '
           f'({100 * st.train_idle_share:.1f} % idle); {st.samples_per_s:.1f} samples/s, '
           f'staleness {st.staleness_mean:.2f} on average (bound {st.max_staleness})</text>',
           f'<text x="10" y="54" fill="#555">{STREAM_STEPS_SHOWN} steps of the simulated '
           'steady state; orange: the weights reach the generator. '
           f'{escape(sources_line(plan))}</text>']
    draw_lanes(out, groups, bars, end, left, top, width, lane_h, gap)
    out.append("</svg>")
    return "\n".join(out)


def render(plan: ExecutionPlan) -> str:
    if plan.streaming is not None:
        return render_stream(plan)
    groups = gpu_groups(plan.cluster.n_gpus,
                        [(a.mesh.first_gpu, a.mesh.n_gpus) for a in plan.allocations])
    end = max((e.end_s for e in plan.timeline), default=1.0) or 1.0
    left, lane_h, gap, width, mem_w = 150, 34, 8, 900, 170
    top = 84
    notes = turns_lines(plan)          # multi-turn generate calls, under the lanes
    height = top + len(groups) * (lane_h + gap) + 70 + 16 * len(notes)
    out = [*head(left + width + mem_w + 40, height),
           f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(plan.name)}: '
           f'{seconds(plan.iteration_time_s, plan.iteration_time_s)} per iteration on '
           f'{escape(plan.cluster.describe())}</text>',
           f'<text x="10" y="38" fill="#555">{plan.n_iters} simulated iterations; bars: '
           'MFC calls and parameter reallocations; right: peak memory per GPU</text>',
           f'<text x="10" y="54" fill="#555">{escape(sources_line(plan))}</text>']
    # iteration boundaries: the end of each iteration's last call
    for it in range(plan.n_iters):
        t = max((e.end_s for e in plan.timeline if e.iteration == it), default=0.0)
        x = left + t * width / end
        out.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" '
                   f'y2="{top + len(groups) * (lane_h + gap)}" stroke="#999" stroke-dasharray="3,3"/>')
        out.append(f'<text x="{x - 4:.1f}" y="{top - 9}" text-anchor="end" fill="#777">'
                   f'iter {it} ends {seconds(t, end)}</text>')
    engines = engine_labels(plan)
    bars = [Bar(e.name + engines.get(e.name, ""), e.kind, e.start_s, e.end_s, e.gpus,
                f" (iter {e.iteration})") for e in plan.timeline]
    ya = draw_lanes(out, groups, bars, end, left, top, width, lane_h, gap)
    for k, (lo, hi) in enumerate(groups):     # peak memory per GPU group
        y = top + k * (lane_h + gap)
        peak = max(plan.peak_mem_bytes[lo:hi + 1])
        frac = min(peak / plan.mem_limit_bytes, 1.0)
        mx = left + width + 20
        out.append(f'<rect x="{mx}" y="{y + 8}" width="{mem_w - 40}" height="{lane_h - 16}" '
                   'fill="none" stroke="#aaa"/>')
        out.append(f'<rect x="{mx}" y="{y + 8}" width="{(mem_w - 40) * frac:.1f}" '
                   f'height="{lane_h - 16}" fill="#9c755f"/>')
        out.append(f'<text x="{mx + mem_w - 36}" y="{y + lane_h / 2 + 4}">'
                   f'{peak / GIB:.0f} GiB</text>')
    out.append(f'<text x="{left + width + 20}" y="{ya - 10}">limit '
               f'{plan.mem_limit_bytes / GIB:.0f} GiB/GPU</text>')
    for i, line in enumerate(notes):
        out.append(f'<text x="10" y="{ya + 10 + 16 * i}" fill="#555">{escape(line)}</text>')
    out.append("</svg>")
    return "\n".join(out)
