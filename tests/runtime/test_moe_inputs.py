"""Bad Qwen3-MoE input is refused before any worker starts (exit 2, no traceback),
naming the field or the file: top-k above the expert count, a checkpoint missing one
expert's weights, and the mixtures of experts realign does not run."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from realign.assets.tiny import make_model, make_tiny_assets

    out = tmp_path_factory.mktemp("moe_assets")
    make_tiny_assets(out, qwen2=False, small=False, families=False, tools=False)
    make_model(out / "moe", "qwen3_moe", seed=3)
    return out


def run_cli(assets: Path, tmp: Path, capsys, actor: Path, command: str = "run",
            extra: tuple[str, ...] = (), name: str = "tiny-grpo-cpu") -> tuple[int, str]:
    from realign.cli.main import main

    cfg = yaml.safe_load((REPO / "experiments" / f"{name}.yaml").read_text())
    cfg["models"]["actor"] = str(actor)
    cfg["data"]["train"]["path"] = str(assets / "math_train.jsonl")
    cfg["reward"]["fn"] = str(REPO / "experiments" / "tiny_reward.py") + ":shaped"
    cfg.setdefault("run", {})["steps"] = 1
    exp = tmp / "exp.yaml"
    exp.write_text(yaml.safe_dump(cfg))
    args = [command, str(exp)] + (["--run-dir", str(tmp / "run")] if command == "run" else [])
    code = main(args + list(extra))
    out = capsys.readouterr()
    return code, out.err if code else out.out


def edited(assets: Path, tmp: Path, edit_config=None, drop: str | None = None) -> Path:
    """A copy of the tiny MoE with its config.json edited or one tensor dropped."""
    dst = tmp / "actor"
    shutil.copytree(assets / "moe", dst)
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop is not None:
        from safetensors.torch import load_file, save_file
        tensors = load_file(str(dst / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_checkpoint_missing_an_experts_weights_is_refused_naming_the_tensor(
        assets, tmp_path, capsys):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    code, err = run_cli(assets, tmp_path, capsys, edited(assets, tmp_path, drop=name))
    assert code == 2 and "Traceback" not in err
    assert "models.actor" in err and f"tensor {name!r} is missing" in err
    assert str(tmp_path / "actor") in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_top_k_above_the_experts_is_refused_naming_the_key(assets, tmp_path, capsys):
    def more(cfg):
        cfg["num_experts_per_tok"] = 9
    code, err = run_cli(assets, tmp_path, capsys, edited(assets, tmp_path, more), "plan")
    assert code == 2 and "Traceback" not in err
    assert "models.actor" in err
    assert "num_experts_per_tok (9) must be at most num_experts (8)" in err


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss", "mixtral", "qwen2_moe"])
def test_other_mixtures_of_experts_are_refused_naming_the_model_type(
        assets, tmp_path, capsys, model_type):
    def other(cfg):
        cfg["model_type"] = model_type
    code, err = run_cli(assets, tmp_path, capsys, edited(assets, tmp_path, other), "plan")
    assert code == 2 and "Traceback" not in err
    assert "models.actor" in err and f"model_type {model_type!r} is not supported" in err
    assert "qwen3_moe" in err            # what is supported


def test_the_tiny_moe_is_planned_with_all_its_experts_in_memory(assets, tmp_path, capsys):
    """The valid checkpoint is planned; the plan's model holds every expert."""
    from planner.specs.model_spec import model_spec_from_hf_config

    out = tmp_path / "plan.json"
    code, _ = run_cli(assets, tmp_path, capsys, assets / "moe", "plan", ("--out", str(out)))
    assert code == 0
    plan = json.loads(out.read_text())
    spec = model_spec_from_hf_config(assets / "moe")
    text = json.dumps(plan)
    assert '"n_experts": 8' in text and '"top_k": 2' in text
    # two sparse layers, each with 6 of its 8 experts (3 x 32 x 64) idle per token
    assert spec.total_params() - spec.active_params() == 2 * 6 * 3 * 32 * 64


def test_lora_on_a_mixture_of_experts_is_refused(assets, tmp_path, capsys):
    code, err = run_cli(assets, tmp_path, capsys, assets / "moe", "plan",
                        name="tiny-grpo-lora-cpu")
    assert code == 2 and "Traceback" not in err
    assert "lora.actor" in err and "LoRA on a mixture of experts (qwen3_moe)" in err
