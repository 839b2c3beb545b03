"""``realign bench plans``: the pure half. Statistics (Kendall tau, spread), the per-plan
and overall summaries on small hand-checked records, the text table and the SVG."""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest

from realign.bench.plans import kendall_tau, spread, summarize, summarize_plan, table
from realign.bench.plans_svg import BANDS, OTHER, SEARCHED, render

NS = "{http://www.w3.org/2000/svg}"
GEN, TRAIN = "actor.generate", "actor.train"


def make_plan(est: dict[str, float], iteration_s: float, realloc_s: float = 0.01) -> dict:
    """A plan JSON with the fields summarize_plan reads."""
    return {"allocations": [{"mfc": m, "layout": {"tp": 1, "pp": 1, "dp": 1},
                             "mesh_name": "m0", "micro_batches": 1, "time_s": t}
                            for m, t in est.items()],
            "reallocations": [{"role": "actor", "to_mfc": GEN, "bytes": 1024,
                               "time_s": realloc_s}],
            "iteration_time_s": iteration_s}


def row(step: float, gen: float | None = None, train: float | None = None,
        realloc: float | None = None) -> dict:
    out = {"step_time_s": step}
    for key, v in ((f"time.{GEN}", gen), (f"time.{TRAIN}", train),
                   (f"time.realloc.{GEN}", realloc)):
        if v is not None:
            out[key] = v
    return out


def entry(label: str, origin: str, iteration_s: float, rounds: list, warmup: int = 0,
          est: dict[str, float] | None = None) -> dict:
    """One plan of a record: ``rounds`` per round a list of rows or an error string."""
    plan = make_plan(est or {GEN: 0.10, TRAIN: 0.20}, iteration_s)
    runs = [{"rows": r} if isinstance(r, list) else {"error": r} for r in rounds]
    return {"label": label, "origin": origin,
            "allocations": {a["mfc"]: "m0 TP1·PP1·DP1 x1" for a in plan["allocations"]},
            "summary": summarize_plan(plan, runs, warmup), "raw": runs, "plan": plan}


def record(plans: list[dict], experiment: str = "exp/ppo.yaml") -> dict:
    return {"study": "plans", "experiment": experiment,
            "config": {"plans": len(plans), "steps": 3, "warmup": 1, "rounds": 2,
                       "profile": "prof.json"},
            "plans": plans, "summary": summarize(plans)}


# ---- kendall_tau ---------------------------------------------------------------------

@pytest.mark.pure
def test_kendall_tau_perfect_and_reversed_order():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)


@pytest.mark.pure
def test_kendall_tau_mixed_by_hand():
    # pairs of (1,2,3,4) vs (1,3,2,4): only (2,3) is discordant -> (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # (1,2,3) vs (2,3,1): concordant (1,2); discordant (1,3), (2,3) -> -1/3
    assert kendall_tau([1, 2, 3], [2, 3, 1]) == pytest.approx(-1 / 3)


@pytest.mark.pure
def test_kendall_tau_b_ties():
    # x tied in one pair: 5 concordant, 1 tied in x only -> 5 / sqrt(6 * 5)
    assert kendall_tau([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / math.sqrt(30))
    # a pair tied in both leaves both factors of the denominator: 2 / sqrt(2 * 2)
    assert kendall_tau([1, 1, 2], [5, 5, 6]) == pytest.approx(1.0)
    # tied in y only, once: 2 concordant -> 2 / sqrt(2 * 3)
    assert kendall_tau([1, 2, 3], [1, 1, 2]) == pytest.approx(2 / math.sqrt(6))


@pytest.mark.pure
def test_kendall_tau_none_without_two_ranked_pairs():
    assert kendall_tau([], []) is None
    assert kendall_tau([1.0], [2.0]) is None
    assert kendall_tau([1, 1, 1], [1, 2, 3]) is None      # constant sample
    assert kendall_tau([2, 2], [3, 3]) is None


# ---- spread ----------------------------------------------------------------------------

@pytest.mark.pure
def test_spread_drops_none_and_takes_the_median():
    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert spread([1.0, 2.0, 3.0, 10.0])["median"] == pytest.approx(2.5)
    empty = {"median": None, "min": None, "max": None, "n": 0}
    assert spread([]) == empty and spread([None]) == empty


# ---- summarize_plan --------------------------------------------------------------------

@pytest.mark.pure
def test_summarize_plan_medians_spreads_errors_by_hand():
    junk = row(9.0, gen=9.0, train=9.0, realloc=9.0)       # the warm-up step, left out
    rounds = [[junk, row(0.30, 0.10, 0.20, 0.02), row(0.32, 0.12, 0.20, 0.02),
               row(0.34, 0.14, 0.26, 0.03)],
              [junk, row(0.40, 0.08, 0.25), row(0.42, 0.10, 0.27)],
              "exit 1; logs in /tmp/x"]
    s = entry("searched", "searched", 0.35, rounds, warmup=1)["summary"]

    assert s["estimated_iteration_s"] == 0.35
    assert s["measured_step"] == {"median": 0.34, "min": 0.30, "max": 0.42, "n": 5}
    assert s["step_round_medians"] == pytest.approx([0.32, 0.41])
    assert s["step_spread_of_rounds"]["min"] == pytest.approx(0.32)
    assert s["step_spread_of_rounds"]["max"] == pytest.approx(0.41)
    assert s["errors"] == ["exit 1; logs in /tmp/x"]

    gen, train = s["mfcs"]
    assert (gen["mfc"], gen["estimated_s"]) == (GEN, 0.10)
    assert gen["measured"] == {"median": 0.10, "min": 0.08, "max": 0.14, "n": 5}
    assert gen["round_medians"] == pytest.approx([0.12, 0.09])
    assert gen["relative_error"] == pytest.approx(0.0)
    assert train["measured"]["median"] == pytest.approx(0.25)
    assert train["spread_of_rounds"]["min"] == pytest.approx(0.20)
    assert train["spread_of_rounds"]["max"] == pytest.approx(0.26)
    assert train["relative_error"] == pytest.approx(0.05 / 0.25)

    (re,) = s["reallocations"]
    assert re["measured"] == {"median": 0.02, "min": 0.02, "max": 0.03, "n": 3}
    assert re["relative_error"] == pytest.approx(0.5)


@pytest.mark.pure
def test_summarize_plan_that_never_ran():
    s = entry("tp2", "variant", 0.5, ["exit 2", "exit 3"])["summary"]
    assert s["measured_step"]["median"] is None and s["step_spread_of_rounds"]["n"] == 0
    assert s["errors"] == ["exit 2", "exit 3"]
    assert [m["relative_error"] for m in s["mfcs"]] == [None, None]
    assert all(m["measured"]["n"] == 0 for m in s["mfcs"])
    assert s["reallocations"][0]["relative_error"] is None


# ---- summarize -------------------------------------------------------------------------

def _three_plans(searched_rounds: list[float], failed_est: float = 0.01) -> list[dict]:
    """searched (est 0.35), a faster heuristic (est 0.30, rounds 0.30 and 0.33), a slow
    variant (est 0.50, 0.60) and a variant that errored (est ``failed_est``)."""
    return [entry("searched", "searched", 0.35, [[row(t, 0.10, 0.20)] for t in searched_rounds]),
            entry("heuristic: all on one mesh", "heuristic", 0.30,
                  [[row(0.30, 0.09, 0.18)], [row(0.33, 0.11, 0.22)]]),
            entry("variant TP2", "variant", 0.50, [[row(0.60, 0.10, 0.40)]]),
            entry("variant PP4", "variant", failed_est, ["exit 1"])]


@pytest.mark.pure
def test_summarize_by_hand_searched_within_spread():
    s = summarize(_three_plans([0.32, 0.36]))
    assert s["fastest_measured"] == "heuristic: all on one mesh"        # median 0.315 < 0.34
    assert s["searched_is_fastest_or_within_spread"] is True             # 0.32 <= 0.33
    # the errored plan (est 0.01, the smallest) is left out, else the order would break
    assert s["kendall_tau_iteration"] == pytest.approx(1.0)
    # errors: searched 0, 0; heuristic |0.1-0.1|/0.1 = 0, |0.2-0.2|/0.2 = 0;
    # TP2 0, |0.2-0.4|/0.4 = 0.5; the errored plan has none
    e = s["mfc_relative_error"]
    assert e["n"] == 6 and e["median"] == pytest.approx(0.0) and e["worst"] == pytest.approx(0.5)


@pytest.mark.pure
def test_summarize_searched_outside_spread_and_searched_fastest():
    s = summarize(_three_plans([0.34, 0.36]))
    assert s["fastest_measured"] == "heuristic: all on one mesh"
    assert s["searched_is_fastest_or_within_spread"] is False            # 0.34 > 0.33
    s = summarize(_three_plans([0.20, 0.22]))
    assert s["fastest_measured"] == "searched"
    assert s["searched_is_fastest_or_within_spread"] is True
    # estimated (0.35, 0.30, 0.50) vs measured (0.21, 0.315, 0.60): searched-heuristic is
    # the one discordant pair of three -> (2 - 1) / 3
    assert s["kendall_tau_iteration"] == pytest.approx(1 / 3)


@pytest.mark.pure
def test_summarize_when_nothing_ran():
    s = summarize([entry("searched", "searched", 0.3, ["exit 1"])])
    assert s["mfc_relative_error"] == {"median": None, "worst": None, "n": 0}
    assert s["kendall_tau_iteration"] is None and s["fastest_measured"] is None
    assert s["searched_is_fastest_or_within_spread"] is None


# ---- table -----------------------------------------------------------------------------

@pytest.mark.pure
def test_table_holds_the_key_numbers():
    text = table(record(_three_plans([0.32, 0.36])))
    assert "exp/ppo.yaml" in text and "prof.json" in text
    assert "searched: iteration est 0.3500 s, measured 0.3400 s (rounds 0.3200-0.3600)" in text
    assert "variant PP4: did not run (exit 1)" in text
    assert "err 50%" in text                                  # TP2's training call
    assert "over 6 MFCs: median 0.0%, worst 50.0%" in text
    assert "Kendall tau (estimated vs measured iteration): 1.00" in text
    assert "fastest measured: heuristic: all on one mesh" in text
    assert "within its spread: True" in text


# ---- render ----------------------------------------------------------------------------

def _svg(rec: dict) -> ET.Element:
    return ET.fromstring(render(rec))


def _texts(root: ET.Element) -> list[str]:
    """Each text element's own words (not its hover title's)."""
    return [t.text or "" for t in root.iter(f"{NS}text")]


@pytest.mark.pure
def test_render_one_circle_per_measured_mfc_and_every_label():
    plans = _three_plans([0.32, 0.36])
    plans[2]["label"] = 'TP2 <mesh "a" & b>'                     # escaped, not broken XML
    root = _svg(record(plans, experiment="exp/a&b.yaml"))
    assert root.tag == f"{NS}svg"
    circles = list(root.iter(f"{NS}circle"))
    assert len(circles) == 6                                   # 3 plans ran x 2 MFCs
    assert sum("searched / actor.train" in "".join(c.itertext()) for c in circles) == 1
    texts = _texts(root)
    for p in plans:
        assert p["label"] in texts
    assert sum(t == "did not run" for t in texts) == 1
    assert "exp/a&b.yaml" in texts[0] and "median 0.0%, worst 50.0%" in texts[0]
    assert "Kendall tau (iteration) 1.00" in texts[0]
    assert GEN in texts and TRAIN in texts                     # the legend


def _line_y(line: ET.Element, x: float) -> float:
    x1, y1, x2, y2 = (float(line.get(k)) for k in ("x1", "y1", "x2", "y2"))
    return y1 + (y2 - y1) * (x - x1) / (x2 - x1)


@pytest.mark.pure
def test_render_points_sit_on_log_axes_against_y_equals_x():
    plans = [entry("a", "searched", 0.3, [[row(0.3, 0.10, 0.40)], [row(0.3, 0.10, 0.40)]]),
             entry("b", "variant", 0.3, [[row(0.3, 0.05, 0.20)], [row(0.3, 0.15, 0.20)]],
                   est={GEN: 0.10, TRAIN: 0.20})]
    root = _svg(record(plans))
    (diag,) = [ln for ln in root.iter(f"{NS}line") if ln.get("stroke-dasharray")]
    pos = {}
    for c in root.iter(f"{NS}circle"):
        pos["".join(c.itertext()).split(":")[0]] = (float(c.get("cx")), float(c.get("cy")))
    # estimated == measured: on the line; measured 2x the estimate: above it (smaller y)
    for key in ("a / actor.generate", "b / actor.generate", "b / actor.train"):
        assert pos[key][1] == pytest.approx(_line_y(diag, pos[key][0]), abs=0.2)
    assert pos["a / actor.train"][1] < _line_y(diag, pos["a / actor.train"][0]) - 10
    # log axes: 0.1 -> 0.2 spans the same distance as 0.2 -> 0.4
    x_gen, x_train = pos["a / actor.generate"][0], pos["b / actor.train"][0]
    y_020, y_040 = pos["b / actor.train"][1], pos["a / actor.train"][1]
    assert y_020 - y_040 == pytest.approx(x_train - x_gen, abs=0.2)
    # b's generate call: rounds 0.05 and 0.15 -> an error bar through its point
    bx, by = pos["b / actor.generate"]
    bars = [ln for ln in root.iter(f"{NS}line") if ln.get("x1") == ln.get("x2")
            and abs(float(ln.get("x1")) - bx) < 0.1 and ln.get("y1") != ln.get("y2")
            and ln.get("stroke-width") == "1.5"]     # a's generate call: a zero-length bar
    assert len(bars) == 1
    ys = sorted(float(bars[0].get(k)) for k in ("y1", "y2"))
    assert ys[0] < by - 10 and ys[1] > by + 10



@pytest.mark.pure
def test_render_bands_are_the_relative_error_of_the_record():
    """The shaded bands hold |est - meas| / meas <= 10 % and 25 %: measured from
    est / (1 + r) up to est / (1 - r), measured on the plot's own log scale."""
    root = _svg(record([entry("a", "searched", 0.3, [[row(0.3, 0.10, 0.40)]])]))
    (diag,) = [ln for ln in root.iter(f"{NS}line") if ln.get("stroke-dasharray")]
    pos = {"".join(c.itertext()).split(":")[0]: (float(c.get("cx")), float(c.get("cy")))
           for c in root.iter(f"{NS}circle")}
    x, y = pos["a / actor.train"]                               # measured 2x the estimate
    per_decade = (_line_y(diag, x) - y) / math.log10(2)
    bands = [p for p in root.iter(f"{NS}polygon") if p.get("clip-path")]
    assert len(bands) == len(BANDS) == 2
    for (r, _fill), band in zip(BANDS, bands):
        pts = [tuple(map(float, xy.split(","))) for xy in band.get("points").split()]
        (x0, below), (_, above) = pts[0], pts[3]
        assert below - _line_y(diag, x0) == pytest.approx(per_decade * math.log10(1 + r), abs=0.3)
        assert _line_y(diag, x0) - above == pytest.approx(-per_decade * math.log10(1 - r), abs=0.3)
    assert {"\u00b110%", "\u00b125%"} <= set(_texts(root))

@pytest.mark.pure
def test_render_bars_highlight_the_searched_plan_and_scale_with_the_median():
    root = _svg(record(_three_plans([0.32, 0.36])))
    bars = {"".join(r.itertext()).split(" (")[0]: r for r in root.iter(f"{NS}rect")
            if r.find(f"{NS}title") is not None}
    assert set(bars) == {"searched", "heuristic: all on one mesh", "variant TP2"}
    assert bars["searched"].get("fill") == SEARCHED
    assert bars["variant TP2"].get("fill") == OTHER
    w = {k: float(r.get("width")) for k, r in bars.items()}
    assert w["variant TP2"] / w["searched"] == pytest.approx(0.60 / 0.34, rel=1e-3)
    bold = [t for t in root.iter(f"{NS}text") if t.get("font-weight") == "bold"]
    assert "searched" in ["".join(t.itertext()) for t in bold]
    # a diamond for every plan's estimate, the one that did not run included
    marks = [p for p in root.iter(f"{NS}polygon")
             if "".join(p.itertext()).startswith("estimated")]
    assert len(marks) == 4



@pytest.mark.pure
def test_render_scale_is_set_by_the_plans_that_ran():
    def widths_and_marks(failed_est: float) -> tuple[list[float], int]:
        root = _svg(record(_three_plans([0.32, 0.36], failed_est=failed_est)))
        bars = [float(r.get("width")) for r in root.iter(f"{NS}rect")
                if r.find(f"{NS}title") is not None]
        marks = [p for p in root.iter(f"{NS}polygon")
                 if "".join(p.itertext()).startswith("estimated")]
        return bars, len(marks)

    small, n_small = widths_and_marks(0.01)
    big, n_big = widths_and_marks(50.0)          # a plan that did not run, priced far off
    assert big == pytest.approx(small) and (n_small, n_big) == (4, 3)

@pytest.mark.pure
def test_render_survives_nothing_run_and_none_values():
    rec = record([entry("searched", "searched", 0.3, ["exit 1"]),
                  entry("v", "variant", 0.4, ["exit 2"])])
    rec["plans"][1]["summary"]["estimated_iteration_s"] = None
    root = _svg(rec)
    assert list(root.iter(f"{NS}circle")) == []
    texts = _texts(root)
    assert texts.count("did not run") == 2 and "searched" in texts and "v" in texts
    assert "median n/a, worst n/a" in texts[0] and "Kendall tau (iteration) n/a" in texts[0]
    assert "no MFC was measured" in texts
    # a bare record: no plans, no summary
    assert ET.fromstring(render({"experiment": "x", "plans": [], "summary": None})).tag == f"{NS}svg"


@pytest.mark.pure
def test_render_axis_labels_keep_apart_beside_long_plan_labels():
    """Long plan labels leave the bar panel narrow: it gets fewer ticks, ~55 px apart."""
    plans = _three_plans([0.32, 0.36])
    for p in plans:
        p["label"] = p["label"] + " with a very long description of its micro-batches"
    root = _svg(record(plans))
    # the bar panel's axis: right of the scatter panel (which ends at x = 80 + 420)
    xs = sorted(float(t.get("x")) for t in root.iter(f"{NS}text")
                if t.get("text-anchor") == "middle" and t.get("fill") == "#555"
                and float(t.get("x")) > 590)
    assert len(xs) >= 2 and min(b - a for a, b in zip(xs, xs[1:])) >= 50
