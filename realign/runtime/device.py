"""The device seam: CPU (gloo, float32) or CUDA (NCCL), and megatron-core's CPU
compatibility layer.

megatron-core 0.16 was written for CUDA. It calls ``torch.cuda.current_device()``,
``torch.cuda.get_rng_state()``, ``torch.cuda.synchronize()``, ``Tensor.cuda()`` and
compares ``Tensor.type()`` with ``'torch.cuda.FloatTensor'``. On CPU these calls are
redirected to their CPU equivalents by :func:`enable_cpu_compat`, which
:func:`init_device` applies only when the device is CPU. On CUDA nothing is patched.
Every other module of the runtime asks this one for its device, backend and dtype;
no other module branches on CUDA.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Literal

import torch

DeviceKind = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class DeviceInfo:
    """What this process computes on."""

    kind: DeviceKind
    device: torch.device
    backend: str            #: torch.distributed backend: gloo on CPU; on CUDA NCCL for
                            #: CUDA tensors and gloo for CPU ones (records)
    dtype: torch.dtype      #: parameter dtype (``dtype``: bf16 on CUDA, fp32 on CPU by default)


_CPU_COMPAT_ON = False

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def default_dtype(kind: DeviceKind) -> str:
    """The parameter dtype a device kind trains in unless told otherwise."""
    return "bf16" if kind == "cuda" else "fp32"


def init_device(kind: DeviceKind | None = None, local_rank: int = 0,
                dtype: str | None = None) -> DeviceInfo:
    """Choose the device (``None``: CUDA when available, else CPU) and prepare it;
    ``dtype``: "bf16" or "fp32" (``None``: :func:`default_dtype`).

    On CPU this enables the megatron-core compatibility layer; on CUDA it sets the
    current device to ``local_rank`` and patches nothing.
    """
    if kind is None:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    param_dtype = DTYPES[dtype or default_dtype(kind)]
    if kind == "cuda":
        if not torch.cuda.is_available():
            from realign.errors import UserError
            raise UserError("CUDA was requested but torch sees no CUDA device; use "
                            "device 'cpu' or install a CUDA build of torch", field="device")
        torch.cuda.set_device(local_rank)
        return DeviceInfo("cuda", torch.device("cuda", local_rank), "cpu:gloo,cuda:nccl",
                          param_dtype)
    enable_cpu_compat()
    return DeviceInfo("cpu", torch.device("cpu"), "gloo", param_dtype)


def enable_cpu_compat() -> None:
    """Redirect the ``torch.cuda`` calls megatron-core makes to CPU equivalents.

    Process-wide and idempotent. Only for a process that has no CUDA device: the
    patched functions would otherwise hide the real GPU.
    """
    global _CPU_COMPAT_ON
    if _CPU_COMPAT_ON:
        return
    assert not torch.cuda.is_available(), "the CPU compatibility layer is for CPU-only processes"
    cuda = torch.cuda
    cpu = torch.device("cpu")
    # the stand-ins' types differ from torch's CUDA API (a CPU device, no streams): the
    # `type: ignore`s below mark the deliberate patches
    cuda.current_device = lambda: cpu  # type: ignore[assignment,return-value]
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator
    cuda.manual_seed = (lambda seed:  # type: ignore[assignment]
                        torch.default_generator.manual_seed(int(seed)))
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.current_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    cuda.default_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    cuda.Stream = _NullStream  # type: ignore[misc,assignment]
    cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    # megatron's RNG tracker sets the state through this private helper
    import megatron.core.tensor_parallel.random as mrandom
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    # torch's device context (used by transformers' loading) recognises constructors
    # by identity from a cached set: fill the cache with the originals first
    from torch.utils import _device
    _device._device_constructors()
    for name in _FACTORIES:             # device="cuda" literals in megatron-core
        setattr(torch, name, _cpu_factory(getattr(torch, name)))
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    _CPU_COMPAT_ON = True


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
              "randint", "zeros_like", "ones_like", "empty_like", "full_like")


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        dev = kwargs.get("device")
        if dev is not None and (dev.type if isinstance(dev, torch.device)
                                else str(dev)).startswith("cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    factory.__wrapped__ = fn
    factory.__name__ = fn.__name__
    return factory


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` on CPU: work is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def cuda_tensor_type_names(info: DeviceInfo) -> Iterator[None]:
    """While building a megatron optimizer on CPU, report CPU float tensors under
    their CUDA type names (megatron checks ``param.type() == 'torch.cuda.FloatTensor'``).
    A no-op on CUDA."""
    if info.kind != "cpu":
        yield
        return
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return name.replace("torch.", "torch.cuda.", 1) if not self.is_cuda else name

    torch.Tensor.type = type_  # type: ignore[method-assign]  # the patch, undone below
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]
