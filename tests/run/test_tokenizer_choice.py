"""``prepare`` records the tokenizer class AutoTokenizer chose for the run's tokenizer
folder (``RunSpec.tokenizer_class``), which every worker builds directly; it survives
the run folder's ``run_spec.json``."""
from __future__ import annotations

import pytest

from realign.run.prepare import prepare
from realign.run.spec import RunSpec
from tests.run.conftest import experiment

pytestmark = pytest.mark.torch


def test_prepare_records_the_tokenizer_class_the_workers_build(tiny_assets, tmp_path):
    from realign.data.tokenizer import load_tokenizer

    spec = prepare(experiment(tiny_assets, "tiny-grpo-cpu", tmp_path),
                   run_dir=str(tmp_path / "run"))
    folder = spec.paths[spec.tokenizer_role]
    assert spec.tokenizer_class == type(load_tokenizer(folder)).__name__ == "TokenizersBackend"
    assert RunSpec.load(tmp_path / "run").tokenizer_class == "TokenizersBackend"
