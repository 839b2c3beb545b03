"""A timeline picture of a plan: one lane per GPU group, a bar per MFC call and per
parameter reallocation, iterations marked, and peak memory per GPU group.

GPU groups are the coarsest split of the cluster that every mesh of the plan is a
union of, so each lane is a set of GPUs that always work together.
"""
from __future__ import annotations

from html import escape

from planner.plan import ExecutionPlan

COLORS = {"generate": "#4e79a7", "inference": "#59a14f", "train": "#e15759",
          "realloc": "#f2a93b"}
GIB = 2 ** 30


def gpu_groups(plan: ExecutionPlan) -> list[tuple[int, int]]:
    """(first, last) GPU of each group: cut the GPU range at every mesh boundary."""
    n = plan.cluster.n_gpus
    cuts = {0, n}
    for a in plan.allocations:
        cuts.add(a.mesh.first_gpu)
        cuts.add(a.mesh.first_gpu + a.mesh.n_gpus)
    pts = sorted(cuts)
    return [(pts[k], pts[k + 1] - 1) for k in range(len(pts) - 1)]


def render(plan: ExecutionPlan) -> str:
    groups = gpu_groups(plan)
    end = max((e.end_s for e in plan.timeline), default=1.0) or 1.0
    left, lane_h, gap, width, mem_w = 150, 34, 8, 900, 170
    top = 72
    height = top + len(groups) * (lane_h + gap) + 70
    sx = width / end
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + mem_w + 40}" '
           f'height="{height}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(plan.name)}: '
           f'{plan.iteration_time_s:.2f} s per iteration on {escape(plan.cluster.describe())}'
           f'</text>',
           f'<text x="10" y="38" fill="#555">{plan.n_iters} simulated iterations; bars: '
           'MFC calls and parameter reallocations; right: peak memory per GPU</text>']
    # iteration boundaries: the end of each iteration's last call
    for it in range(plan.n_iters):
        t = max((e.end_s for e in plan.timeline if e.iteration == it), default=0.0)
        x = left + t * sx
        out.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" '
                   f'y2="{top + len(groups) * (lane_h + gap)}" stroke="#999" stroke-dasharray="3,3"/>')
        out.append(f'<text x="{x - 4:.1f}" y="{top - 9}" text-anchor="end" fill="#777">'
                   f'iter {it} ends {t:.1f}s</text>')
    for k, (lo, hi) in enumerate(groups):
        y = top + k * (lane_h + gap)
        label = f"GPU {lo}" if lo == hi else f"GPUs {lo}-{hi}"
        out.append(f'<rect x="{left}" y="{y}" width="{width}" height="{lane_h}" fill="#f4f4f4"/>')
        out.append(f'<text x="{left - 8}" y="{y + lane_h / 2 + 4}" text-anchor="end">{label}</text>')
        for e in plan.timeline:
            if not any(lo <= g <= hi for g in e.gpus):
                continue
            x, w = left + e.start_s * sx, max((e.end_s - e.start_s) * sx, 1.0)
            color = COLORS.get(e.kind, "#999")
            out.append(f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{lane_h - 4}" '
                       f'fill="{color}" stroke="white" stroke-width="0.5">'
                       f'<title>{escape(e.name)} (iter {e.iteration}): {e.start_s:.3f}-'
                       f'{e.end_s:.3f} s</title></rect>')
            short = e.name if e.kind != "realloc" else "realloc"
            if w > 7 * len(short):
                out.append(f'<text x="{x + 3:.1f}" y="{y + lane_h / 2 + 4}" fill="white">'
                           f'{escape(short)}</text>')
        # memory bar
        peak = max(plan.peak_mem_bytes[lo:hi + 1])
        frac = min(peak / plan.mem_limit_bytes, 1.0)
        mx = left + width + 20
        out.append(f'<rect x="{mx}" y="{y + 8}" width="{mem_w - 40}" height="{lane_h - 16}" '
                   'fill="none" stroke="#aaa"/>')
        out.append(f'<rect x="{mx}" y="{y + 8}" width="{(mem_w - 40) * frac:.1f}" '
                   f'height="{lane_h - 16}" fill="#9c755f"/>')
        out.append(f'<text x="{mx + mem_w - 36}" y="{y + lane_h / 2 + 4}">'
                   f'{peak / GIB:.0f} GiB</text>')
    # axis and legend
    ya = top + len(groups) * (lane_h + gap) + 6
    for k in range(6):
        t = end * k / 5
        out.append(f'<text x="{left + t * sx:.1f}" y="{ya + 10}" text-anchor="middle" '
                   f'fill="#555">{t:.1f}s</text>')
    lx = left
    for kind, color in COLORS.items():
        out.append(f'<rect x="{lx}" y="{ya + 24}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{lx + 16}" y="{ya + 34}">{kind}</text>')
        lx += 100
    out.append(f'<text x="{left + width + 20}" y="{ya + 34}">limit '
               f'{plan.mem_limit_bytes / GIB:.0f} GiB/GPU</text>')
    out.append("</svg>")
    return "\n".join(out)
