"""Whether vLLM is installed is looked up, not imported: a folder named ``vllm`` on the
path without an ``__init__`` (pytest puts ``tests/`` there, and ``tests/vllm`` is such a
folder) is not vLLM, a package with one is."""
from __future__ import annotations

import importlib
import sys

import pytest

pytestmark = pytest.mark.pure


def test_a_namespace_folder_named_vllm_is_not_vllm(tmp_path, monkeypatch):
    from realign.run.vllm_check import vllm_installed

    (tmp_path / "vllm").mkdir()
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    importlib.invalidate_caches()
    assert not vllm_installed()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    importlib.invalidate_caches()
    assert vllm_installed()
