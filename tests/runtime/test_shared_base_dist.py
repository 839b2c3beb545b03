"""Scoring with the adapters off is the frozen base: a LoRA replica (random adapters, a
moved value head) with its adapters off gives the log-probs, values and scores of a
separately loaded copy of its checkpoint bit for bit at TP1 and TP2, and its adapters
are back afterwards. One 2-rank world (conftest)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu_dist


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("head,model,packing", [("lm", "llama", False), ("lm", "qwen2", True),
                                                ("value", "llama_rm", False)])
def test_adapters_off_equals_a_separately_loaded_copy(world2, tiny_models, tp, head, model,
                                                      packing):
    res = [r for r in world2.run("cases_shared_base:adapters_off_scoring", tiny_models[model],
                                 head, tp, packing) if r is not None]
    assert len(res) == (2 if tp == 2 else 1)
    for equal, on_diff, restored in res:
        assert equal and all(equal.values()), equal      # bit for bit, every output
        assert on_diff > 1e-3                            # the adapters (and head) act
        assert restored
