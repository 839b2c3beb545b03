"""planner.cost.profile (the measured table: JSON round trip, schema check, GEMM grid and
collective curves) and realign.profile.fit (the fits ``realign profile`` writes it
with), against hand computation and synthetic data made from known constants.

GEMM grid used below (FLOP/s, forward), rows 1 and 100 by widths 10 and 1000:

                 width 10   width 1000
    rows 1         1e9        1e11
    rows 100       1e10       1e12

Interpolation is bilinear in (log rows, log width) on log rate, so halfway on both
log axes (rows 10, width 100) is the geometric mean of the four corners, 10^10.5.
"""
from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from planner.cost.profile import (
    PROFILE_SCHEMA_VERSION,
    CollectiveCurve,
    EngineCosts,
    GemmGrid,
    ProbePoint,
    ProfileTable,
    Provenance,
    TransferCosts,
    size_envelope,
)
from planner.errors import PlanError
from realign.profile.fit import fit_collective, fit_relative, fit_transfer

pytestmark = pytest.mark.pure

GRID = GemmGrid(rows=(1, 100), widths=(10, 1000),
                forward_flops_per_s=((1e9, 1e11), (1e10, 1e12)),
                train_flops_per_s=((2e9, 2e9), (8e9, 8e9)))


def approx(x, rel=1e-12):
    return pytest.approx(x, rel=rel, abs=0)


def full_table() -> ProfileTable:
    return ProfileTable(
        device="toy",
        measured=Provenance(host="h", date="2024-01-01", workers=2, threads_per_worker=4,
                            fit_rms_relative_error={"train": 0.05},
                            probes=(ProbePoint(engine="train", model=(2, 64, 128),
                                               layout=(1, 2, 1), args=(8, 32, 2),
                                               measured_s=0.5, fitted_s=0.48),)),
        gemm=GRID, mem_bytes_per_s=4e11,
        engines={"train": EngineCosts(call_s=1e-3, layer_s=2e-5, param_s=3e-10),
                 "decode": EngineCosts(microbatch_s=1e-4, collective_s=5e-6)},
        collectives=(CollectiveCurve(op="all_reduce", group_size=2, latency_s=5e-6,
                                     bytes_per_s=1e10, points=((1e3, 6e-6), (1e6, 1.1e-4))),
                     CollectiveCurve(op="p2p", group_size=2, inter_node=True, latency_s=1e-5,
                                     bytes_per_s=1e9)),
        realloc=TransferCosts(fixed_s=0.1, per_tensor_s=1e-4, bytes_per_s=1e9),
        send=TransferCosts(fixed_s=1e-3, bytes_per_s=5e9))


# ---- JSON and the schema check ------------------------------------------------------------

def test_json_round_trip(tmp_path):
    table = full_table()
    path = tmp_path / "profile.json"
    path.write_text(table.model_dump_json(indent=1))
    assert json.loads(path.read_text())["schema_version"] == PROFILE_SCHEMA_VERSION == 2
    assert "source" not in json.loads(path.read_text())      # where it was loaded from
    back = ProfileTable.load(path)
    assert back.source == str(path)
    assert back.model_copy(update={"source": ""}) == table
    assert back.engines["decode"].collective_s == 5e-6
    assert back.collectives[0].points == ((1e3, 6e-6), (1e6, 1.1e-4))


@pytest.mark.parametrize("version", [1, 3, None])
def test_wrong_schema_version_is_a_clear_error(tmp_path, version):
    raw = json.loads(full_table().model_dump_json())
    if version is None:
        del raw["schema_version"]
    else:
        raw["schema_version"] = version
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError) as e:
        ProfileTable.load(path)
    assert e.value.field == "plan.profile"
    assert f"schema_version {version}" in e.value.message
    assert "reads 2" in e.value.message and "realign profile" in e.value.message


def test_load_errors_name_the_file_and_the_field(tmp_path):
    with pytest.raises(PlanError, match="no profile table") as e:
        ProfileTable.load(tmp_path / "missing.json")
    assert e.value.field == "plan.profile"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not a readable profile table"):
        ProfileTable.load(bad)
    bad.write_text("[2]")
    with pytest.raises(PlanError, match="not a readable profile table"):
        ProfileTable.load(bad)
    raw = json.loads(full_table().model_dump_json())
    raw["gemm"]["rows"] = [100, 1]
    bad.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="gemm.rows must be positive and ascending"):
        ProfileTable.load(bad)
    raw = json.loads(full_table().model_dump_json())
    raw["engines"]["train"]["layer_seconds"] = 1.0
    bad.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match=r"engines\.train\.layer_seconds"):
        ProfileTable.load(bad)


@pytest.mark.parametrize("update,msg", [
    ({"rows": (100, 1)}, "gemm.rows must be positive and ascending"),
    ({"widths": (0, 10)}, "gemm.widths must be positive and ascending"),
    ({"forward_flops_per_s": ((1e9, 1e11),)}, r"gemm.forward_flops_per_s must be \[rows\]"),
    ({"train_flops_per_s": ((1e9, 0.0), (1e9, 1e9))}, "positive finite"),
])
def test_gemm_grid_validation(update, msg):
    with pytest.raises(ValidationError, match=msg):
        GemmGrid(**{**GRID.model_dump(), **update})


# ---- GEMM grid --------------------------------------------------------------------------

@pytest.mark.parametrize("rows,width,expected", [
    (1, 10, 1e9), (100, 1000, 1e12), (1, 1000, 1e11), (100, 10, 1e10),   # the points
    (10, 10, 10 ** 9.5),        # halfway on log rows between 1e9 and 1e10
    (1, 100, 1e10),             # halfway on log width between 1e9 and 1e11
    (10, 100, 10 ** 10.5),      # the geometric mean of the four corners
    # 3/4 of the way on both: 1/4 (3/4 x 11 + 1/4 x 9) + 3/4 (3/4 x 12 + 1/4 x 10) = 11.25
    (10 ** 1.5, 10 ** 2.5, 10 ** 11.25),
    (0.5, 5, 1e9), (1e4, 1e5, 1e12), (1e4, 100, 1e11),                 # clamped
])
def test_gemm_grid_rate_is_bilinear_on_log_axes(rows, width, expected):
    assert GRID.rate(rows, width, train=False) == approx(expected, rel=1e-9)


def test_gemm_grid_train_and_single_points():
    # train grid: 2e9 at 1 row, 8e9 at 100 rows (any width); 10 rows: sqrt(2e9 x 8e9)
    assert GRID.rate(10, 50, train=True) == approx(4e9, rel=1e-9)
    one = GemmGrid(rows=(8,), widths=(64,), forward_flops_per_s=((3e10,),),
                   train_flops_per_s=((2e10,),))
    assert one.rate(1, 1, False) == approx(3e10) and one.rate(1e6, 1e6, True) == approx(2e10)


# ---- collective curves ------------------------------------------------------------------------

CURVE = CollectiveCurve(op="all_reduce", group_size=4, latency_s=5e-6, bytes_per_s=1e10,
                        points=((1e3, 1e-5), (1e6, 1e-4), (1e4, 2e-5)))    # unsorted


@pytest.mark.parametrize("nbytes,expected", [
    (100, 1e-5),                                   # below the smallest: its time
    (1e3, 1e-5), (1e4, 2e-5), (1e6, 1e-4),         # the points
    (5.5e3, 1.5e-5),                               # halfway between 1e3 and 1e4
    (5.05e5, 6e-5),                                # halfway between 1e4 and 1e6
    (2e6, 1e-4 + 1.5 * 1e6 / 1e10),                # above: the last + the rest at the fit
])
def test_collective_curve_interpolates_and_extrapolates(nbytes, expected):
    assert CURVE.time_s(nbytes, 1.5) == approx(expected, rel=1e-9)


def test_collective_curve_without_points_is_its_fit():
    bare = CURVE.model_copy(update={"points": ()})
    assert bare.time_s(1e6, 1.5) == approx(5e-6 + 1.5e6 / 1e10)
    single = CURVE.model_copy(update={"points": ((1e3, 1.0),)})
    assert single.time_s(1e6, 1.0) == approx(5e-6 + 1e6 / 1e10)


def test_a_size_slowed_by_a_neighbour_is_priced_as_the_next_larger_one():
    """Moving more bytes never takes less time: 256 B measured at 3 ms (something else
    ran) between 8 B at 0.17 ms and 4 KiB at 0.33 ms counts as 0.33 ms; the table keeps
    what was measured."""
    pts = ((8, 1.7e-4), (256, 3e-3), (4096, 3.3e-4), (65536, 3.5e-4))
    assert size_envelope(pts) == [(8.0, 1.7e-4), (256.0, 3.3e-4), (4096.0, 3.3e-4),
                                  (65536.0, 3.5e-4)]
    c = CURVE.model_copy(update={"points": pts})
    assert c.time_s(1024, 1.0) == approx(3.3e-4, rel=1e-12)
    assert c.time_s(132, 1.0) == approx(1.7e-4 + (3.3e-4 - 1.7e-4) * 124 / 248, rel=1e-12)
    fit = fit_collective("all_reduce", 2, list(pts))
    assert fit.points == pts and fit.latency_s < 3.5e-4


def test_table_picks_the_nearest_measured_group_size():
    def c(n, inter=False, op="all_reduce"):
        return CollectiveCurve(op=op, group_size=n, inter_node=inter, latency_s=n * 1e-6,
                               bytes_per_s=1e9)
    t = ProfileTable(device="toy", collectives=(c(2), c(8), c(4, inter=True), c(2, op="p2p")))
    assert t.collective("all_reduce", 2, False).group_size == 2
    assert t.collective("all_reduce", 3, False).group_size == 2      # log2: 0.58 vs 1.42
    assert t.collective("all_reduce", 4, False).group_size == 8      # a tie: the larger
    assert t.collective("all_reduce", 64, False).group_size == 8
    assert t.collective("all_reduce", 16, True).group_size == 4      # same node span only
    assert t.collective("all_gather", 2, False) is None
    assert t.collective("p2p", 2, True) is None


# ---- fits (realign profile) ---------------------------------------------------------------

def test_fit_relative_recovers_the_constants():
    # time = base + 1e-3 calls + 2e-5 layers + 3e-10 params, columns of very different scale
    true = [1e-3, 2e-5, 3e-10]
    rows = [[1, 8, 1e6], [2, 4, 5e7], [1, 32, 2e8], [4, 16, 1e5], [3, 2, 7e7]]
    base = [0.01, 0.0, 0.02, 0.005, 0.0]
    y = [b + sum(a * c for a, c in zip(r, true)) for r, b in zip(rows, base)]
    coef, rms = fit_relative(rows, y, base)
    assert coef == [approx(v, rel=1e-9) for v in true]
    assert rms < 1e-12


def test_fit_relative_gives_zero_to_unused_and_negative_columns():
    # column 1 is all zeros: 0
    coef, _ = fit_relative([[1, 0], [2, 0]], [2.0, 4.0])
    assert coef == [approx(2.0, rel=1e-12), 0.0]
    # times fall as x grows: the slope would be negative, so it is dropped and the
    # constant alone minimises sum ((c - y)/y)^2, i.e. c = sum(1/y) / sum(1/y^2)
    y = [3.0, 2.9, 2.8]
    coef, rms = fit_relative([[1, 1], [1, 2], [1, 3]], y)
    c = sum(1 / v for v in y) / sum(1 / v ** 2 for v in y)
    assert coef == [approx(c, rel=1e-9), 0.0]
    assert rms == approx(math.sqrt(sum(((c - v) / v) ** 2 for v in y) / 3), rel=1e-9)


def test_fit_relative_rms_of_an_imperfect_fit():
    # one constant through 1 and 3: c = (1 + 1/3) / (1 + 1/9) = 1.2; errors +0.2, -0.6
    coef, rms = fit_relative([[1], [1]], [1.0, 3.0])
    assert coef == [approx(1.2, rel=1e-12)]
    assert rms == approx(math.sqrt((0.2 ** 2 + 0.6 ** 2) / 2), rel=1e-9)


def test_robust_fit_is_not_pulled_by_a_slowed_probe():
    # time = 1e-3 calls + 2e-5 layers; the last probe ran 3x slow (a busy neighbour)
    rows = [[1, 8], [2, 4], [1, 32], [4, 16], [3, 2], [2, 64], [1, 1], [5, 40]]
    y = [1e-3 * a + 2e-5 * b for a, b in rows]
    slowed = y[:-1] + [3 * y[-1]]
    ls, _ = fit_relative(rows, slowed)
    robust, rms = fit_relative(rows, slowed, huber=0.1)
    assert robust == [approx(1e-3, rel=0.01), approx(2e-5, rel=0.01)]
    assert abs(ls[0] / 1e-3 - 1) > 0.03                  # least squares moves 3.4 %
    # the RMS is still over every point: the slowed one is 2/3 off
    assert rms == approx(math.sqrt((2 / 3) ** 2 / len(rows)), rel=1e-2)
    # without outliers the robust fit is the least-squares one
    assert fit_relative(rows, y, huber=0.1)[0] == [approx(1e-3, rel=1e-9), approx(2e-5, rel=1e-9)]


@pytest.mark.parametrize("op,n,factor", [("all_reduce", 4, 1.5), ("all_gather", 8, 7 / 8),
                                         ("broadcast", 8, 1.0), ("p2p", 2, 1.0)])
def test_fit_collective_recovers_latency_and_bandwidth(op, n, factor):
    lat, bw = 7e-6, 2e10
    pts = [(b, lat + factor * b / bw) for b in (1e3, 1e5, 1e7, 1e8)]
    c = fit_collective(op, n, pts, inter_node=True)
    assert (c.op, c.group_size, c.inter_node) == (op, n, True)
    assert c.latency_s == approx(lat, rel=1e-6)
    assert c.bytes_per_s == approx(bw, rel=1e-6)
    assert c.points == tuple(pts)


def test_fit_collective_without_size_dependence_keeps_the_largest_point():
    c = fit_collective("all_reduce", 2, [(1e3, 1e-5), (1e6, 1e-5)])
    assert c.latency_s == approx(1e-5, rel=1e-9)
    assert c.time_s(1e6, 1.0) == approx(1e-5, rel=1e-9)
    assert c.bytes_per_s > 1e15     # no measurable bandwidth term


def test_fit_transfer_recovers_fixed_per_tensor_and_bandwidth():
    fixed, per_tensor, bw = 2e-3, 1e-5, 1e9
    raw = [(0.01, 10, 1e6), (0.0, 100, 1e8), (0.05, 1000, 1e7), (0.001, 1, 1e5),
           (0.0, 50, 5e8)]
    pts = [(e, t, b, e + fixed + per_tensor * t + b / bw) for e, t, b in raw]
    c = fit_transfer(pts)
    assert c.fixed_s == approx(fixed, rel=1e-6)
    assert c.per_tensor_s == approx(per_tensor, rel=1e-6)
    assert c.bytes_per_s == approx(bw, rel=1e-6)
