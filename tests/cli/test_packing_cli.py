"""train.packing from the YAML to the plan: bad values exit 2 before anything runs; a
packed plan prices its scoring and training lower and says what it priced."""
from __future__ import annotations

import json

import pytest
from test_plan_cli import SMALL, with_, write

from realign.cli.main import main

pytestmark = pytest.mark.pure

TAILED = with_(with_(SMALL, "algorithm.gen_len", 1024), "algorithm.gen_len_mean", 200)


@pytest.mark.parametrize("value", ["yes", 1, "sometimes", None])
def test_bad_packing_values_exit_2(tmp_path, capsys, value):
    rc = main(["plan", str(write(tmp_path, with_(SMALL, "train", {"packing": value})))])
    err = capsys.readouterr().err
    assert rc == 2 and "train.packing" in err and "Traceback" not in err


def test_packing_with_megatrons_forward_exits_2(tmp_path, capsys):
    cfg = with_(SMALL, "train", {"packing": True, "forward": "megatron"})
    assert main(["plan", str(write(tmp_path, cfg))]) == 2
    err = capsys.readouterr().err
    assert "train.packing: false" in err and "forward" in err


def test_a_packed_plan_prices_tokens_and_says_so(tmp_path, capsys):
    times, lines = {}, {}
    for packing in (False, True):
        cfg = with_(TAILED, "train", {"packing": packing})
        assert main(["plan", str(write(tmp_path, cfg, f"{packing}.yaml")), "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        times[packing] = {m["name"]: m["time_s"] for m in s["mfcs"]}
        lines[packing] = s["lengths"]
    for name in ("ref.inference", "critic.inference", "actor.train", "critic.train"):
        assert times[True][name] < times[False][name], name
    assert times[True]["actor.generate"] == pytest.approx(times[False]["actor.generate"],
                                                         rel=0.2)
    assert lines[True]["packed"] and not lines[False]["packed"]
    assert lines[True]["row_mean"] < lines[True]["padded_mean"]
