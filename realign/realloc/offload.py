"""Free and restore the storage behind a model replica's parameters.

Two uses in an RLHF iteration:

* **release / restore** — the copy a reallocation made for another call (say the
  actor's generation layout) is dropped after that call: :func:`release` shrinks
  its storages to zero bytes so the memory returns to the allocator, and
  :func:`restore` gives them their size back (contents undefined) before the next
  reallocation refills them. The trained copy (and its optimizer state) is untouched.
* **offload / reload** — a model that does not train (reference, reward) is copied to
  host memory and its device storage freed (:func:`offload`); :func:`reload` puts the
  bytes back into the *same* storages. Tensors and views that pointed at them (a
  model's parameters, logical-shard views) stay valid and read bit-identical values.

Works per storage, not per tensor: several views of one storage (a flat parameter
buffer) are freed and restored once, as a whole. The device seam is the tensors' own
device: the host copy is ``.to('cpu', copy=True)`` of the storage's bytes (pinned
when the device is not the CPU, so the copies run at full DMA speed); on CPU "host" and
"device" are the same memory, yet the storage really is freed and refilled.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Distinct non-empty storages behind ``tensors``, in first-seen order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen[st.data_ptr()] = st
    return list(seen.values())


def _bytes_of(st: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


@dataclass
class Released:
    """Storages freed by :func:`release`, with the sizes :func:`restore` gives back."""

    storages: list[torch.UntypedStorage]
    nbytes: list[int]

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)


def release(tensors: Iterable[torch.Tensor]) -> Released:
    """Free the storage of ``tensors`` (values are lost); returns what to restore."""
    return _release_storages(_storages(tensors))


def _release_storages(sts: list[torch.UntypedStorage]) -> Released:
    sizes = [st.nbytes() for st in sts]
    for st in sts:
        st.resize_(0)
    return Released(sts, sizes)


def restore(released: Released) -> None:
    """Give released storages their size back (contents undefined until refilled)."""
    for st, n in zip(released.storages, released.nbytes):
        if st.nbytes() != 0:
            raise RuntimeError("restore() of a storage that is not released")
        st.resize_(n)


@dataclass
class Offloaded:
    """Host copies of freed device storages; :func:`reload` puts them back."""

    released: Released
    host: list[torch.Tensor]   #: one uint8 host tensor per storage

    @property
    def total_bytes(self) -> int:
        return self.released.total_bytes


def offload(tensors: Iterable[torch.Tensor]) -> Offloaded:
    """Copy the storage of ``tensors`` to host memory and free it on the device."""
    sts = _storages(tensors)
    host = []
    for st in sts:
        dev_bytes = _bytes_of(st)
        if dev_bytes.device.type == "cpu":
            host.append(dev_bytes.to("cpu", copy=True))
        else:
            h = torch.empty(dev_bytes.shape, dtype=torch.uint8, pin_memory=True)
            h.copy_(dev_bytes)
            host.append(h)
    return Offloaded(_release_storages(sts), host)


def reload(off: Offloaded) -> None:
    """Restore the storages and copy the host bytes back into them."""
    restore(off.released)
    for st, h in zip(off.released.storages, off.host):
        _bytes_of(st).copy_(h)  # synchronous: the storage is usable on return
