"""Damaged run folders, as a kill or a user leaves them: a rerun of a finished run whose
final model, newest checkpoint, metrics lines or folder entries are damaged, and a
damaged job index entry. Each says what ``realign`` does: writes again, falls back, or
refuses with exit code 2 naming the files (no traceback, no worker started)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.run.conftest import experiment
from tests.run.run_records import metrics

pytestmark = pytest.mark.cpu_dist


@pytest.fixture(scope="module")
def finished_run(tiny_assets, tmp_path_factory) -> tuple[Path, str]:
    """A finished 4-step run with checkpoints after steps 2 and 4."""
    from realign.cli.main import main

    tmp = tmp_path_factory.mktemp("finished")
    exp = str(experiment(tiny_assets, "tiny-grpo-cpu", tmp, run__steps=4,
                         run__checkpoint_interval=2))
    assert main(["run", exp, "--run-dir", str(tmp / "run")]) == 0
    return tmp / "run", exp


def _copy(finished_run, tmp_path) -> Path:
    rd = tmp_path / "run"
    shutil.copytree(finished_run[0], rd)
    return rd


def _rerun(finished_run, rd: Path, capsys, *extra) -> tuple[int, str]:
    from realign.cli.main import main

    capsys.readouterr()
    code = main(["run", finished_run[1], "--run-dir", str(rd), *extra])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, (out + err)[-3000:]
    return code, out + err


def _weights(folder: Path) -> dict:
    """The tensors of a HF folder, read into memory (not mapped: the test damages files)."""
    from safetensors.torch import load
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load(f.read_bytes()))
    return out


def test_a_damaged_final_model_is_written_again(finished_run, tmp_path, capsys):
    import torch

    rd = _copy(finished_run, tmp_path)
    want = _weights(rd / "final" / "actor")
    shard = next((rd / "final" / "actor").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])          # a kill during the final save
    (rd / "final" / "actor" / "tokenizer.json").unlink()
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 0 and "writing it again" in text
    got = _weights(rd / "final" / "actor")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (rd / "final" / "actor" / "tokenizer.json").is_file()
    assert (rd / "final" / "actor.damaged").is_dir()      # set aside, not deleted
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 0 and "already finished" in text


def test_a_truncated_newest_checkpoint_falls_back_and_is_kept(finished_run, tmp_path, capsys):
    rd = _copy(finished_run, tmp_path)
    shutil.rmtree(rd / "final")
    newest = rd / "checkpoints" / "step_000004" / "rank1.pt"
    newest.write_bytes(newest.read_bytes()[:50])
    # a user's backup copy and a cut-off metrics line must not trouble the resume
    shutil.copytree(rd / "checkpoints" / "step_000002", rd / "checkpoints" / "step_000002.bak")
    with open(rd / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 0, text[-3000:]
    assert "step_000004 is damaged" in text and "rank1.pt" in text
    assert "resuming from" in text and "step_000002" in text
    assert (rd / "checkpoints" / "step_000004.damaged").is_dir()
    assert (rd / "checkpoints" / "step_000002.bak").is_dir()
    rows = metrics(rd)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert (rd / "final" / "actor" / "config.json").is_file()


def test_no_intact_checkpoint_is_an_input_error_naming_the_files(finished_run, tmp_path, capsys):
    rd = _copy(finished_run, tmp_path)
    for step in ("step_000002", "step_000004"):
        (rd / "checkpoints" / step / "rank0.pt").unlink()
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 2 and "no intact checkpoint" in text and "rank0.pt is missing" in text
    # an exit-2 refusal changes nothing on disk: no checkpoint is renamed or removed
    assert sorted(p.name for p in (rd / "checkpoints").iterdir()) == ["step_000002",
                                                                      "step_000004"]
    assert "Nothing was changed" in text


def test_a_damaged_metrics_line_is_restored_from_its_checkpoint(finished_run, tmp_path, capsys):
    """The last step's metrics line is damaged but the checkpoint after it is intact:
    the rerun restores the line from the checkpoint (each checkpoint keeps the lines of
    the steps it covers), so metrics.jsonl has every step exactly once."""
    rd = _copy(finished_run, tmp_path)
    want = (rd / "metrics.jsonl").read_text().splitlines()
    damaged = want[:3] + [want[3][:20]]                    # step 3's line cut off
    (rd / "metrics.jsonl").write_text("\n".join(damaged) + "\n")
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 0 and "already finished" in text, text[-3000:]
    assert "restored the metrics of step 3 from checkpoint step_000004" in text
    assert (rd / "metrics.jsonl").read_text().splitlines() == want
    # a line missing in the middle comes back too, in step order, and a resumed run
    # (the final model written again) keeps every step exactly once
    (rd / "metrics.jsonl").write_text("\n".join(want[:1] + want[2:] + want[3:]) + "\n")
    shutil.rmtree(rd / "final")
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 0 and "restored the metrics of step 1 from checkpoint step_000002" in text
    assert (rd / "metrics.jsonl").read_text().splitlines() == want


def test_a_checkpoint_of_another_optimizer_sharding_is_refused_before_workers(
        finished_run, tmp_path, capsys):
    rd = _copy(finished_run, tmp_path)
    shutil.rmtree(rd / "final")
    shutil.rmtree(rd / "logs")
    exp = yaml.safe_load(Path(finished_run[1]).read_text())
    exp["train"]["distributed_optimizer"] = True
    other = Path(finished_run[1]).with_name(f"{tmp_path.name}-zero1.yaml")   # beside its assets
    other.write_text(yaml.safe_dump(exp))
    from realign.cli.main import main
    capsys.readouterr()
    code = main(["run", str(other), "--run-dir", str(rd)])
    text = "".join(capsys.readouterr())
    assert code == 2 and "train.distributed_optimizer: false" in text
    assert "Traceback" not in text and not (rd / "logs").exists()


@pytest.mark.parametrize("name,make", [
    ("checkpoints", lambda p: p.write_text("x")), ("final", lambda p: p.write_text("x")),
    ("tensorboard", lambda p: p.write_text("x")), ("metrics.jsonl", lambda p: p.mkdir())])
def test_a_run_folder_entry_of_the_wrong_kind_is_left_alone(finished_run, tmp_path, capsys,
                                                           name, make):
    rd = _copy(finished_run, tmp_path)
    shutil.rmtree(rd / "logs")
    target = rd / name
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    make(target)
    code, text = _rerun(finished_run, rd, capsys)
    assert code == 2 and f"{target} is a" in text and "move it away" in text
    assert not (rd / "logs").exists()


def test_a_damaged_job_index_entry(tmp_path, monkeypatch, capsys):
    from realign.cli.main import main

    monkeypatch.setenv("REALIGN_HOME", str(tmp_path))
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "local-7.json").write_text('{"backend": "local", "job_')
    assert main(["status", "local-7"]) == 2
    err = capsys.readouterr().err
    assert "JOB" in err and "local-7.json is damaged" in err and "Traceback" not in err
