"""``realign.bench.studies.moe_seeds``'s EP control (pure): ``--grpo-ep`` moves every
``plan.manual`` call of the shipped GRPO stage to another expert parallelism and nothing
else; an experiment without ``plan.manual`` is refused."""
from __future__ import annotations

import copy

import pytest
import yaml

from realign.bench.studies.checkout import REPO
from realign.bench.studies.moe_seeds import with_ep

pytestmark = pytest.mark.pure


def test_the_control_moves_only_the_expert_parallelism():
    shipped = yaml.safe_load((REPO / "experiments" / "demo-moe-grpo.yaml").read_text())
    manual = shipped["plan"]["manual"]
    assert {m: a["layout"].get("ep") for m, a in manual.items()} == dict.fromkeys(manual, 2)
    control = with_ep(copy.deepcopy(shipped), 1)
    for mfc, alloc in control["plan"]["manual"].items():
        assert alloc["layout"] == {**manual[mfc]["layout"], "ep": 1}
        assert alloc["mesh"] == manual[mfc]["mesh"]
    assert {k: v for k, v in control.items() if k != "plan"} == {
        k: v for k, v in shipped.items() if k != "plan"}


def test_no_manual_plan_is_refused():
    with pytest.raises(SystemExit, match="plan.manual"):
        with_ep({"plan": {}}, 1)
