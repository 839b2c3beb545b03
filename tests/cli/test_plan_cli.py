"""`realign plan`: output, files written, exit codes and error messages."""
from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from planner.plan import ExecutionPlan
from realign.cli.main import main

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[2]

SMALL = {
    "name": "small-ppo",
    "models": {"actor": "llama2-7b", "critic": "llama2-7b", "ref": "llama2-7b",
               "reward": "llama2-7b"},
    "algorithm": {"name": "ppo", "prompts_per_step": 64, "prompt_len": 128, "gen_len": 128,
                  "ppo_minibatches": 2},
    "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "a100-80g"},
    "plan": {"method": "anneal", "time_limit_s": 10, "seed": 0, "anneal_steps": 20000},
}


def write(tmp_path: Path, cfg: dict, name: str = "exp.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def with_(cfg: dict, path: str, value) -> dict:
    out = json.loads(json.dumps(cfg))
    cur = out
    keys = path.split(".")
    for k in keys[:-1]:
        cur = cur[k]
    if value is _DELETE:
        del cur[keys[-1]]
    else:
        cur[keys[-1]] = value
    return out


_DELETE = object()


def test_json_summary_and_files(tmp_path, capsys):
    exp = write(tmp_path, SMALL)
    out, svg = tmp_path / "o" / "plan.json", tmp_path / "o" / "plan.svg"
    rc = main(["plan", str(exp), "--json", "--out", str(out), "--timeline", str(svg)])
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert set(s["heuristics"]) == {"megatron", "deepspeed-chat", "openrlhf"}
    assert s["iteration_time_s"] > 0 and s["search_time_s"] > 0
    names = [m["name"] for m in s["mfcs"]]
    assert names == ["actor.generate", "reward.inference", "ref.inference",
                     "critic.inference", "actor.train", "critic.train"]
    for m in s["mfcs"]:
        assert m["tp"] * m["pp"] * m["dp"] == m["n_gpus"]
        assert set(m) >= {"mesh", "tp", "pp", "dp", "micro_batches", "time_s", "mem_bytes"}
    for t in s["heuristics"].values():
        assert t is None or s["iteration_time_s"] <= t
    plan = ExecutionPlan.load(out)
    assert plan.iteration_time_s == s["iteration_time_s"]
    assert plan == ExecutionPlan.from_json(out.read_text())
    root = ET.fromstring(svg.read_text())          # well-formed SVG
    text = svg.read_text()
    assert root.tag.endswith("svg") and "actor.generate" in text and "GiB" in text


def test_table_output(tmp_path, capsys):
    rc = main(["plan", str(write(tmp_path, SMALL))])
    out = capsys.readouterr().out
    assert rc == 0
    assert "estimated iteration time" in out and "megatron" in out
    assert "actor.train" in out and "faster" in out


def test_shipped_experiments_parse():
    from realign.run.loading import load_experiment
    for p in sorted((REPO / "experiments").glob("*.yaml")):
        cfg = load_experiment(p)
        assert cfg.name


@pytest.mark.parametrize("cfg, needles", [
    (with_(SMALL, "algorithm.colour", "red"), ["algorithm.colour", "unknown key", "gen_len"]),
    (with_(SMALL, "algorithm.name", "ppx"), ["algorithm.name", "ppx", "grpo"]),
    (with_(SMALL, "algorithm.gen_len", -3), ["algorithm.gen_len", "-3"]),
    (with_(SMALL, "cluster.device", "tpu-v9"), ["cluster.device", "tpu-v9", "h100-80g"]),
    (with_(SMALL, "models.actor", "no/such/model"), ["models.actor", "no/such/model", "preset"]),
    (with_(SMALL, "models.critic", _DELETE), ["models", "critic"]),
    (with_(SMALL, "plan.method", "magic"), ["plan.method", "magic", "anneal"]),
    (with_(SMALL, "algorithm", _DELETE), ["algorithm", "missing"]),
    (with_(with_(SMALL, "plan.cost", {"distributed_optimizer": False}), "device", "cuda"),
     ["plan.cost.distributed_optimizer", "train.distributed_optimizer", "cuda"]),
])
def test_bad_yaml_fields_exit_2(tmp_path, capsys, cfg, needles):
    rc = main(["plan", str(write(tmp_path, cfg))])
    err = capsys.readouterr().err
    assert rc == 2
    for n in needles:
        assert n in err, (n, err)
    assert "Traceback" not in err


def test_not_yaml_and_missing_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    assert main(["plan", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "nope.yaml")]) == 2
    assert "no experiment file" in capsys.readouterr().err


def test_infeasible_names_what_and_smallest_cluster(tmp_path, capsys):
    cfg = with_(SMALL, "models", {r: "llama2-70b" for r in ("actor", "critic", "ref", "reward")})
    rc = main(["plan", str(write(tmp_path, cfg))])
    err = capsys.readouterr().err
    assert rc == 2
    assert "smallest cluster that fits" in err.lower()
    assert "nodes x 8" in err


def test_hf_config_path_model(tmp_path, capsys):
    cfgjson = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
               "model_type": "llama"}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfgjson))
    cfg = {"name": "hf", "models": {"actor": "m"},
           "algorithm": {"name": "sft", "prompts_per_step": 8, "prompt_len": 16, "gen_len": 16,
                         "ppo_minibatches": 1},
           "cluster": {"nodes": 1, "gpus_per_node": 2, "device": "cpu"}}
    assert main(["plan", str(write(tmp_path, cfg)), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["mfcs"][0]["name"] == "actor.train"


def test_bad_override_and_unwritable_out(tmp_path, capsys):
    exp = write(tmp_path, SMALL)
    assert main(["plan", str(exp), "--time-limit", "-1"]) == 2
    assert "--time-limit" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["plan", str(exp), "--out", str(tmp_path / "file" / "plan.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_console_script_exit_code_without_traceback(tmp_path):
    exp = write(tmp_path, with_(SMALL, "cluster.nodes", 0))
    r = subprocess.run([sys.executable, "-m", "realign.cli.main", "plan", str(exp)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "cluster.nodes" in r.stderr and "Traceback" not in r.stderr


def test_planning_never_imports_torch(tmp_path):
    exp = write(tmp_path, SMALL)
    code = ("import sys; from realign.cli.main import main; "
            f"rc = main(['plan', {str(exp)!r}, '--json']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("device,train,cost,priced", [
    ("cuda", None, None, True), ("cpu", None, None, False),     # unset: by device
    ("cpu", True, None, True), ("cuda", False, None, False),    # the run's choice
    ("cpu", False, False, False), ("cuda", None, True, True)])  # stated alike
def test_the_cost_model_prices_the_optimizer_the_run_uses(device, train, cost, priced):
    from realign.config.experiment import ExperimentConfig
    from realign.run.planning import cost_config

    cfg = with_(SMALL, "device", device)
    if train is not None:
        cfg["train"] = {"distributed_optimizer": train}
    if cost is not None:
        cfg["plan"]["cost"] = {"distributed_optimizer": cost}
    exp = ExperimentConfig.model_validate(cfg)
    assert cost_config(exp).distributed_optimizer is priced
    assert exp.train.uses_distributed_optimizer(device) is priced


def test_a_sharded_optimizer_shrinks_the_memory_the_plan_counts():
    from realign.config.experiment import ExperimentConfig
    from realign.run.plan_source import resolve_plan
    from realign.run.planning import resolve_models

    alloc = {"mesh": {"first_gpu": 0, "n_gpus": 8}, "layout": {"tp": 4, "pp": 1, "dp": 2}}
    base = {"name": "g", "models": {"actor": "llama2-7b"}, "device": "cuda",
            "algorithm": {"name": "grpo", "prompts_per_step": 8, "samples_per_prompt": 2,
                          "prompt_len": 64, "gen_len": 64, "params": {"kl_coef": 0.0}},
            "cluster": {"nodes": 1, "gpus_per_node": 8, "device": "a100-80g"},
            "plan": {"manual": {"actor.generate": alloc, "actor.train": alloc}}}
    mem = {}
    for zero1 in (True, False):
        cfg = ExperimentConfig.model_validate(dict(base, train={"distributed_optimizer": zero1}))
        plan = resolve_plan(cfg, resolve_models(cfg))
        mem[zero1] = plan.allocation("actor.train").mem_bytes
    # Adam state + fp32 master weights: 12 bytes per parameter, half of it per DP rank
    params_per_gpu = 6.7e9 / 4
    assert mem[False] - mem[True] == pytest.approx(12 * params_per_gpu / 2, rel=0.05)
