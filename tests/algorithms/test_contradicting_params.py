"""Hyper-parameters that contradict each other are refused (``algorithm.params``): each
pair of docs/algorithms.md's list, at the path of the one named first, naming the other
with both values and what is allowed; the values beside them that agree are accepted.
Through ``realign run``: tests/run/test_contradicting_params_run.py."""
from __future__ import annotations

import pytest

from planner.graph.algorithms import BatchShape
from realign.algorithms.params import ClippedPGParams
from realign.algorithms.params_table import PARAMS, make_params
from realign.errors import UserError

pytestmark = pytest.mark.pure

CLIPPED_PG = sorted(n for n, c in PARAMS.items() if issubclass(c, ClippedPGParams))


def shape(gen_len: int = 8, dropped_group_frac: float | None = None) -> BatchShape:
    return BatchShape(prompts_per_step=4, samples_per_prompt=2, prompt_len=8, gen_len=gen_len,
                      dropped_group_frac=dropped_group_frac)


#: (algorithm, params, batch shape, the field refused, the other field, what the
#: message says besides both values)
CONTRADICTIONS = [
    *[(a, {"clip_ratio": 0.28, "clip_ratio_high": 0.2}, shape(),
       "algorithm.params.clip_ratio_high", "algorithm.params.clip_ratio 0.28",
       "0.2 contradicts") for a in ("dapo", "gspo")],
    *[(a, {"tis_cap": 2.0, "behave_weight_cap": 3.0}, shape(),
       "algorithm.params.behave_weight_cap", "algorithm.params.tis_cap 2.0",
       "3.0 contradicts") for a in CLIPPED_PG],
    *[(a, {"loss": "ipo", "label_smoothing": 0.1}, shape(),
       "algorithm.params.label_smoothing", "algorithm.params.loss 'ipo'",
       "0.1 contradicts") for a in ("dpo", "online_dpo")],
    ("dapo", {"overlong_buffer_frac": 0.05}, shape(8),
     "algorithm.params.overlong_buffer_frac", "algorithm.gen_len 8",
     "above 0.0625 and below 0.9375 (this one is round(0.4) = 0 tokens)"),
    ("dapo", {"overlong_buffer_frac": 0.95}, shape(8),
     "algorithm.params.overlong_buffer_frac", "algorithm.gen_len 8", "= 8 tokens"),
    ("dapo", {}, shape(1),                        # the default 0.2 of a 1-token cap
     "algorithm.params.overlong_buffer_frac", "algorithm.gen_len 1",
     "a gen_len of 1 token leaves no room for a buffer"),
    ("dapo", {"overlong_penalty": 2.0, "overlong_buffer_frac": 0.0}, shape(),
     "algorithm.params.overlong_penalty", "algorithm.params.overlong_buffer_frac 0.0",
     "2.0 contradicts"),
    ("dapo", {"overlong_buffer_frac": 0.25, "overlong_penalty": 0.0}, shape(),
     "algorithm.params.overlong_buffer_frac", "algorithm.params.overlong_penalty 0.0",
     "0.25 contradicts"),
    ("dapo", {"dynamic_sampling": False}, shape(dropped_group_frac=0.25),
     "algorithm.params.dynamic_sampling", "algorithm.dropped_group_frac 0.25",
     "only dynamic sampling drops"),
    ("dapo", {"dynamic_sampling": False, "max_sampling_rounds": 3}, shape(),
     "algorithm.params.max_sampling_rounds", "dynamic_sampling", "max_sampling_rounds 3"),
    ("dapo", {"max_round_prompts": 60}, shape(), "algorithm.params.max_round_prompts",
     "algorithm.params.max_sampling_rounds 1", "60 contradicts"),
]


@pytest.mark.parametrize("algorithm,params,batch,field,other,says", CONTRADICTIONS,
                         ids=[f"{c[0]}-{c[3].rsplit('.', 1)[1]}-{i}"
                              for i, c in enumerate(CONTRADICTIONS)])
def test_contradicting_hyper_parameters_are_refused(algorithm, params, batch, field, other,
                                                    says):
    with pytest.raises(UserError) as e:
        make_params(algorithm, params, batch)
    assert e.value.field == field
    assert other in e.value.message and says in e.value.message, e.value.message
    assert "allowed:" in e.value.message or "set dynamic_sampling: true" in e.value.message


@pytest.mark.parametrize("algorithm,params,batch", [
    ("dapo", {"clip_ratio": 0.2, "clip_ratio_high": 0.2}, shape()),       # symmetric
    ("gspo", {"clip_ratio": 3e-4, "clip_ratio_high": 4e-4}, shape()),
    *[(a, {"tis_cap": 2.0, "behave_weight_cap": 2.0}, shape()) for a in CLIPPED_PG],
    *[(a, {"tis_cap": 2.0}, shape()) for a in CLIPPED_PG],
    ("dpo", {"loss": "ipo"}, shape()),
    ("online_dpo", {"loss": "sigmoid", "label_smoothing": 0.1}, shape()),
    ("dapo", {"overlong_buffer_frac": 0.07}, shape(8)),                    # 1 token
    ("dapo", {"overlong_buffer_frac": 0.9}, shape(8)),                     # 7 tokens
    ("dapo", {"overlong_buffer_frac": 0.0}, shape(1)),
    ("dapo", {"overlong_buffer_frac": 0.0}, shape()),     # the default penalty, unused
    ("dapo", {"overlong_penalty": 0.0}, shape()),         # the default buffer, unused
])
def test_hyper_parameters_that_agree_are_accepted(algorithm, params, batch):
    p = make_params(algorithm, params, batch)
    assert {k: getattr(p, k) for k in params} == params


@pytest.mark.parametrize("key,value,says", [
    ("clip_ratio", 1.0, "less than 1"),          # 1 - clip_ratio: a positive ratio
    ("behave_weight_cap", 0.5, "greater than or equal to 1"),
    ("tis_cap", 0.9, "greater than or equal to 1"),
])
@pytest.mark.parametrize("algorithm", CLIPPED_PG)
def test_bounds_against_one(algorithm, key, value, says):
    with pytest.raises(UserError) as e:
        make_params(algorithm, {key: value}, shape())
    assert e.value.field == f"algorithm.params.{key}" and says in e.value.message


def test_a_reloaded_run_keeps_its_parameters():
    """What the experiment did not write is not held against it: the prepared run
    reloads every field, written or not."""
    p = make_params("dapo", {"tis_cap": 2.0, "overlong_penalty": 0.0}, shape())
    assert type(p).model_validate_json(p.model_dump_json()) == p

