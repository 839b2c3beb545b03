"""train.packing from the YAML to the plan: bad values exit 2 before anything runs; a
packed plan prices its scoring and training lower and says what it priced."""
from __future__ import annotations

import json

import pytest
import yaml
from test_plan_cli import REPO, SMALL, with_, write

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


@pytest.mark.parametrize("value", ["yes", 2, None])
def test_bad_refill_values_exit_2(tmp_path, capsys, value):
    rc = main(["plan", str(write(tmp_path, with_(SMALL, "rollout", {"refill": value})))])
    err = capsys.readouterr().err
    assert rc == 2 and "rollout.refill" in err and "Traceback" not in err


def test_a_refilling_plan_prices_fewer_decode_steps_and_says_so(tmp_path, capsys):
    """Generation that refills its slots (the default) is priced by its expected steps,
    below waves that each wait for their longest, on the shipped long-tail GRPO setting
    (2048 rollouts of 900 tokens on average, cap 3840: more rows than the KV cache
    holds); the plan's lengths line says both."""
    base = yaml.safe_load((REPO / "experiments/grpo-llama3.1-8b-16gpu-longtail.yaml")
                          .read_text())
    times, gens = {}, {}
    for refill in (False, True):
        cfg = with_(base, "rollout", {**base.get("rollout", {}), "refill": refill})
        assert main(["plan", str(write(tmp_path, cfg, f"{refill}.yaml")), "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        times[refill] = {m["name"]: m for m in s["mfcs"]}["actor.generate"]["time_s"]
        gens[refill] = s["lengths"]["generation"]
    assert gens[True]["refill"] and not gens[False]["refill"]
    assert gens[True]["decode_steps"] < 0.8 * gens[True]["wave_steps"]
    assert gens[False]["decode_steps"] == gens[False]["wave_steps"]
    assert times[True] < 0.8 * times[False]
    assert main(["plan", str(write(tmp_path, base, "default.yaml"))]) == 0
    assert "refills its slots" in capsys.readouterr().out
