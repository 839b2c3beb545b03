"""`realign run` with LoRA on CPU: SIGKILL and resume bit-identical with checkpoints that
hold only the adapters, the final adapter in PEFT's format (loaded by peft on the base,
equal to the merged checkpoint), adapter-only reallocation between layouts, and bad
input refused with exit 2 before any worker starts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from realign.run.checkpoint import committed
from tests.run.conftest import experiment, kill_after
from tests.run.run_records import metrics

pytestmark = pytest.mark.cpu_dist

REALIGN = [sys.executable, "-m", "realign.cli.main"]


def run(exp: Path, run_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*REALIGN, "run", str(exp), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=timeout)


def refused(exp: Path, run_dir: Path, capsys) -> str:
    """``realign run`` of ``exp`` in this process (a refusal starts no worker, and the
    imports are paid once per test process, not once per case): its stderr, after
    checking it exited 2."""
    from realign.cli.main import main
    capsys.readouterr()
    code = main(["run", str(exp), "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    return err


def lora_exp(assets: Path, tmp: Path, **changes) -> Path:
    """The shipped LoRA experiment on the tiny random actor (no warm start), no eval."""
    changes.setdefault("run__steps", 6)
    return experiment(assets, "tiny-grpo-lora-cpu", tmp, models__actor="tiny/actor",
                      eval=None, **changes)


def rewards(run_dir: Path) -> list[float]:
    return [row["reward_mean"] for row in metrics(run_dir)]


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_identical_and_checkpoints_hold_adapters(
        tiny_assets, tmp_path):
    # with adapter dropout: its masks are drawn again alike after the resume
    exp = lora_exp(tiny_assets, tmp_path, run__steps=16, run__checkpoint_interval=2,
                   lora__actor__dropout=0.1)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    r = run(exp, whole)
    assert r.returncode == 0, r.stderr[-3000:]
    kill_after(exp, cut, 3)
    found = committed(cut)
    assert found, "no committed checkpoint before the kill"
    r = run(exp, cut)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout
    a = load_file(whole / "final" / "actor" / "adapter_model.safetensors")
    b = load_file(cut / "final" / "actor" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert rewards(whole) == rewards(cut)
    # a checkpoint keeps the adapters and their optimizer state, not the frozen base
    state = torch.load(committed(cut)[-1][1] / "rank0.pt", weights_only=False)
    modules = [v["module"] for v in state.values() if isinstance(v, dict) and "module" in v]
    assert modules and all(k.endswith(("lora_A", "lora_B")) for m in modules for k in m)


def test_final_adapter_loads_with_peft_and_equals_the_merged_checkpoint(tiny_assets, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exp = lora_exp(tiny_assets, tmp_path, lora__actor__merged=True)
    r = run(exp, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    final = tmp_path / "run" / "final" / "actor"
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    base = AutoModelForCausalLM.from_pretrained(tiny_assets / "tiny" / "actor")
    ids = torch.tensor([[3, 17, 5, 9, 12, 4, 8, 30]])
    with torch.no_grad():
        plain = base(ids).logits
        peft = PeftModel.from_pretrained(base, str(final)).eval()
        adapted = peft(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(final / "merged")(ids).logits
    assert (adapted - plain).abs().max() > 1e-4          # training moved the adapters
    assert (adapted - merged).abs().max() < 1e-4


def test_reallocation_moves_only_the_adapters(tiny_assets, tmp_path):
    """Train at TP2 and generate at TP1·DP2 on the same two GPUs: the plan prices the
    adapters' bytes only, and the run moves exactly those (the executor checks)."""
    from planner.cost.realloc_cost import ReallocModel, realloc_recv_send
    from planner.specs.lora import LoraSpec
    from realign.runtime.hf_checkpoint import spec_from_hf

    both = {"mesh": {"first_gpu": 0, "n_gpus": 2}}
    manual = {"actor.generate": {**both, "layout": {"tp": 1, "pp": 1, "dp": 2}},
              "actor.train": {**both, "layout": {"tp": 2, "pp": 1, "dp": 1}}}
    exp = lora_exp(tiny_assets, tmp_path, plan__manual=manual)
    r = run(exp, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    (moved,) = [x["bytes"] for x in plan["reallocations"] if x["role"] == "actor"]
    spec = spec_from_hf(tiny_assets / "tiny" / "actor")

    def closed(lora):
        acc = realloc_recv_send(ReallocModel.of(spec, "lm", 4, lora), (0, 2, 2, 1, 1),
                                (0, 2, 1, 1, 2), 2)
        return sum(sum(v) for v in acc.recv.values())
    assert moved == closed(LoraSpec(rank=8)) > 0
    assert moved * 9 < closed(None)       # 36,864 against 360,448 bytes (rank 8 of a width 64)
    rows = metrics(tmp_path / "run")
    got = sum(v for k, v in rows[-1].items() if k.startswith("realloc_bytes.actor.generate"))
    assert got == moved


@pytest.mark.parametrize("changes,field,needle", [
    ({"lora__actor__rank": 0}, "lora.actor.rank", "greater than 0"),
    ({"lora__actor__target_modules": ["lm_head"]}, "lora.actor.target_modules",
     "matches no layer"),
    ({"lora__critic": {"rank": 4}}, "lora.critic", "no models.critic"),
    ({"lora__ref": {"rank": 4}}, "lora.ref", "Input should be"),
    ({"lora__actor__init_from": "tiny/small_actor"}, "lora.actor.init_from",
     "not a PEFT adapter folder"),
    ({"rollout__engine": "vllm", "lora__actor__rank": 1024}, "lora.actor.rank", "up to 512"),
    ({"lora__actor__alpha": 0}, "lora.actor.alpha", "greater than 0"),
])
def test_bad_lora_input_exits_2_naming_the_field(tiny_assets, tmp_path, capsys, changes, field,
                                                 needle):
    err = refused(lora_exp(tiny_assets, tmp_path, **changes), tmp_path / "run", capsys)
    assert field in err and needle in err, err[-2000:]
    assert not (tmp_path / "run").exists()


def test_an_adapter_made_for_another_base_exits_2(tiny_assets, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(tiny_assets / "tiny" / "small_actor")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    get_peft_model(other, LoraConfig(r=8, lora_alpha=16, target_modules=targets)
                   ).save_pretrained(str(tmp_path / "adapter"))
    err = refused(lora_exp(tiny_assets, tmp_path,
                           lora__actor__init_from=str(tmp_path / "adapter")),
                  tmp_path / "run", capsys)
    assert "lora.actor.init_from" in err and "another base" in err, err[-2000:]


@pytest.mark.parametrize("peft_fields,lora_fields,needle", [
    ({"use_dora": True}, {}, "use_dora=True"),
    ({"use_rslora": True}, {}, "use_rslora=True"),
    ({}, {"lora__actor__shared_a": True}, "have different lora_A"),
    ({"target_modules": ["q_proj", "v_proj"]}, {}, "the adapter adapts ['q_proj', 'v_proj']"),
])
def test_a_peft_adapter_realign_cannot_run_as_set_exits_2(tiny_assets, tmp_path, capsys,
                                                          peft_fields, lora_fields, needle):
    """PEFT adapters of the actor's own base that these settings cannot start from: DoRA,
    rsLoRA's scale, fused parts with their own A under shared_a, other projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_assets / "tiny" / "actor")
    fields = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", **peft_fields}
    get_peft_model(base, LoraConfig(**fields)).save_pretrained(str(tmp_path / "adapter"))
    err = refused(lora_exp(tiny_assets, tmp_path,
                           lora__actor__init_from=str(tmp_path / "adapter"), **lora_fields),
                  tmp_path / "run", capsys)
    assert "lora.actor.init_from" in err and needle in err, err[-2000:]
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_lora_reward_model_loads_with_peft_as_a_sequence_classifier(tiny_assets, tmp_path):
    """Reward modelling with LoRA: the final folder (adapters and the trained score head as
    PEFT's modules_to_save) loads with peft on the base classifier and scores like the
    merged checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    exp = experiment(tiny_assets, "tiny-rm-cpu", tmp_path, run__steps=4,
                     lora={"reward": {"rank": 4, "alpha": 8, "merged": True}})
    r = run(exp, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    final = tmp_path / "run" / "final" / "reward"
    assert json.loads((final / "adapter_config.json").read_text())["modules_to_save"] == ["score"]
    base = AutoModelForSequenceClassification.from_pretrained(tiny_assets / "tiny" / "reward")
    ids = torch.tensor([[3, 17, 5, 9, 12, 4, 8, 30]])
    with torch.no_grad():
        before = base(ids).logits
        peft = PeftModel.from_pretrained(base, str(final)).eval()
        scored = peft(ids).logits
        merged = AutoModelForSequenceClassification.from_pretrained(final / "merged")(ids).logits
    assert (scored - before).abs().max() > 1e-5          # trained adapters and head
    assert (scored - merged).abs().max() < 1e-4


def test_merging_a_model_the_run_does_not_hand_over_exits_2(tiny_assets, tmp_path, capsys):
    exp = experiment(tiny_assets, "tiny-ppo-cpu", tmp_path, run__steps=1,
                     lora={"critic": {"rank": 4, "merged": True}})
    err = refused(exp, tmp_path / "run", capsys)
    assert "lora.critic.merged" in err and "only the actor" in err, err[-2000:]
