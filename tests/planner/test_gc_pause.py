"""The search holds Python's cyclic collector off while it works and leaves it as it
found it (planner/search/gc_pause.py)."""
from __future__ import annotations

import gc

import pytest

from planner.search.gc_pause import gc_paused

pytestmark = pytest.mark.pure


def test_off_inside_and_restored_after_even_on_error():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()       # the outer block still holds it off
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("inside")
    assert gc.isenabled()


def test_left_off_when_it_was_off():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
