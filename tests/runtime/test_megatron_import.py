"""A worker imports megatron-core with its torch.compile decorations deferred to first
call (realign/runtime/megatron_import.py): what compiles still compiles, with the same
options, once; torch.compile is itself again afterwards; TorchInductor is not imported."""
from __future__ import annotations

import subprocess
import sys

import pytest

from realign.runtime.megatron_import import compile_deferred, deferred

pytestmark = pytest.mark.torch


class FakeCompile:
    """torch.compile's shape: records what it compiled and with which options."""

    def __init__(self):
        self.calls: list[tuple[object, dict]] = []

    def __call__(self, model=None, **options):
        self.calls.append((model, options))
        return lambda *a, **k: ("compiled", model(*a, **k))


def test_compiles_on_first_call_once_with_the_same_options():
    fake = FakeCompile()

    def double(x):
        """Twice x."""
        return 2 * x

    f = deferred(fake)(double, dynamic=False)
    assert fake.calls == []                          # nothing compiled at decoration
    assert f.__name__ == "double" and f.__doc__ == "Twice x."
    assert f(3) == ("compiled", 6)
    assert f(x=4) == ("compiled", 8)
    assert fake.calls == [(double, {"dynamic": False})]


def test_the_decorator_form_with_options():
    fake = FakeCompile()

    @deferred(fake)(fullgraph=True)
    def inc(x):
        return x + 1

    assert fake.calls == []
    assert inc(1) == ("compiled", 2)
    assert [opts for _, opts in fake.calls] == [{"fullgraph": True}]


def test_torch_compile_restored_after_the_block_even_on_an_error():
    import torch

    eager = torch.compile
    with pytest.raises(RuntimeError, match="boom"), compile_deferred():
        assert torch.compile is not eager
        raise RuntimeError("boom")
    assert torch.compile is eager


@pytest.mark.slow
def test_megatron_imported_without_inductor():
    """In a fresh interpreter (as a worker): megatron-core's modules are there, its fused
    kernels are the deferred wrappers, TorchInductor was never imported."""
    code = (
        "import sys, torch\n"
        "eager = torch.compile\n"
        "from realign.runtime.megatron_import import MEGATRON_MODULES, import_megatron\n"
        "import_megatron()\n"
        "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
        "print(all(m in sys.modules for m in MEGATRON_MODULES),\n"
        "      torch.compile is eager, bias_gelu.__name__,\n"
        "      'torch._inductor.compile_fx' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "bias_gelu", "False"]
