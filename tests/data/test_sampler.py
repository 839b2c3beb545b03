"""PromptSampler: deterministic, covers every row once per epoch, resumes exactly."""
from __future__ import annotations

import itertools

import pytest

from realign.data.sampler import PromptSampler
from realign.errors import UserError

pytestmark = pytest.mark.pure


def _take(s: PromptSampler, k: int) -> list[list[int]]:
    return [s.next_batch() for _ in range(k)]


def test_docstring_example():
    assert _take(PromptSampler(5, 2, shuffle=False), 4) == [[0, 1], [2, 3], [4, 0], [1, 2]]


@pytest.mark.parametrize("n,batch", [(10, 3), (7, 7), (4, 9), (80, 8)])
def test_each_epoch_is_a_permutation(n, batch):
    s = PromptSampler(n, batch, seed=5)
    stream = list(itertools.chain.from_iterable(_take(s, 3 * n)))
    assert all(len(b) == batch for b in _take(PromptSampler(n, batch, 5), 5))
    epochs = [stream[i * n:(i + 1) * n] for i in range(len(stream) // n)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    if n >= 7:
        assert epochs[0] != epochs[1] and epochs[0] != list(range(n))


def test_deterministic_and_seeded():
    assert _take(PromptSampler(50, 4, seed=1), 30) == _take(PromptSampler(50, 4, seed=1), 30)
    assert _take(PromptSampler(50, 4, seed=1), 30) != _take(PromptSampler(50, 4, seed=2), 30)


@pytest.mark.parametrize("stop", [0, 1, 3, 4, 7, 12])
def test_resume_gives_the_same_batches(stop):
    full = _take(PromptSampler(13, 4, seed=3), 20)
    a = PromptSampler(13, 4, seed=3)
    _take(a, stop)
    state = a.state_dict()
    b = PromptSampler(13, 4, seed=3)
    b.load_state_dict(dict(state))
    assert b.epoch == a.epoch == stop * 4 // 13
    assert _take(b, 20 - stop) == full[stop:]


def test_resume_with_another_dataset_is_refused():
    state = PromptSampler(13, 4, seed=3).state_dict()
    for kwargs, field in [(dict(n=14, batch=4, seed=3), "sampler.n"),
                          (dict(n=13, batch=2, seed=3), "sampler.batch"),
                          (dict(n=13, batch=4, seed=4), "sampler.seed")]:
        with pytest.raises(UserError) as e:
            PromptSampler(**kwargs).load_state_dict(state)
        assert e.value.field == field
    with pytest.raises(UserError, match="consumed"):
        PromptSampler(13, 4, 3).load_state_dict({**state, "consumed": -1})


def test_bad_arguments():
    with pytest.raises(UserError):
        PromptSampler(0, 4)
    with pytest.raises(UserError):
        PromptSampler(4, 0)
