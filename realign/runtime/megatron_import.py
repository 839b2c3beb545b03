"""megatron-core imported with its ``torch.compile`` decorations deferred to first call.

megatron-core wraps its fused kernels (bias-GeLU, SwiGLU, cross entropy, dropout, norms)
in ``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2. Applying
``torch.compile`` as a decorator imports TorchDynamo and TorchInductor at once (about
2 CPU seconds a process, most of what importing megatron-core costs beyond torch),
although realign's models call none of these kernels on the local layer spec
(``runtime/model.py`` turns the fusions off; with ``train.transformer_engine`` on CUDA,
bias-dropout-add runs fused). :func:`import_megatron` imports the megatron-core modules
realign uses while ``torch.compile`` returns a wrapper that compiles, with the same
arguments, on the wrapped function's first call: a kernel that runs is compiled with the
arguments megatron-core gave, one that never runs costs nothing. ``torch.compile`` is
restored before the function returns.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

# every megatron-core package realign imports (realign/runtime/*): each one that applies
# jit_fuser must be first imported here, or its decorations would import TorchInductor
MEGATRON_MODULES = (
    "megatron.core",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer.transformer_block",
)


def deferred(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``compile_fn`` (``torch.compile``'s signature) that compiles on first call."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:                      # the decorator form: @torch.compile(...)
            return lambda m: compile_later(m, **options)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(compile_fn(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    return compile_later


@contextlib.contextmanager
def compile_deferred() -> Iterator[None]:
    """``torch.compile`` deferred to first call (:func:`deferred`) inside the block."""
    import torch

    eager = torch.compile
    torch.compile = deferred(eager)
    try:
        yield
    finally:
        torch.compile = eager


def import_megatron() -> None:
    """Import :data:`MEGATRON_MODULES` with their kernels' compilation deferred."""
    with compile_deferred():
        for name in MEGATRON_MODULES:
            importlib.import_module(name)
