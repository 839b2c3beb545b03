"""Records: the data an MFC reads and writes, as named tensors, and how they move
between workers (point to point, never through the controller).

A record is a ``dict[str, Tensor | list]`` stored under a graph key (``seqs``,
``logprobs``, ``rewards``...). Sequences are right-padded ``tokens`` [b, s] with
``lengths`` [b] and ``prompt_lengths`` [b]; per-token log-probs are [b, s-1], where
position t scores token t+1.

One device convention: records live on the CPU, on every device kind (the engines
move what they read to their device and hand back CPU tensors). They travel over the
world group's CPU backend: gloo, which a CUDA run's world group has beside NCCL
(``cpu:gloo,cuda:nccl``), so a CPU run exercises exactly the CUDA run's record path.
"""
from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

from realign.data.collate import pad_right

Record = dict[str, object]


def sequences_from_generation(prompts: list[list[int]], gen_tokens: torch.Tensor,
                              gen_logprobs: torch.Tensor, gen_lengths: torch.Tensor,
                              pad_id: int) -> tuple[Record, Record]:
    """(``seqs`` record, ``logprobs`` record) from prompts and their continuations."""
    prompt_tokens, plen = pad_right(prompts, pad_id)
    glen = gen_lengths.cpu().long()
    b, n = gen_tokens.shape
    s = int((plen + glen).max())
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    tokens[:, :prompt_tokens.shape[1]] = prompt_tokens
    valid = torch.arange(n).unsqueeze(0) < glen.unsqueeze(1)                # [b, n]
    rows = torch.arange(b).unsqueeze(1).expand(b, n)[valid]
    cols = (plen.unsqueeze(1) + torch.arange(n).unsqueeze(0))[valid]
    tokens[rows, cols] = gen_tokens.cpu()[valid]
    logprobs = torch.zeros(b, s - 1, dtype=torch.float32)
    logprobs[rows, cols - 1] = gen_logprobs.cpu().float()[valid]
    seqs: Record = {"tokens": tokens, "lengths": plen + glen, "prompt_lengths": plen}
    return seqs, {"logprobs": logprobs}


def send_record(rec: Record, dst: int) -> None:
    """Header (names, shapes, dtypes, non-tensor values) then each tensor (on the CPU)."""
    header = {k: (("tensor", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor)
                  else ("object", v)) for k, v in rec.items()}
    dist.send_object_list([header], dst=dst, device=torch.device("cpu"))
    for _k, v in rec.items():
        if isinstance(v, torch.Tensor):
            dist.send(v.cpu().contiguous(), dst=dst)


def recv_record(src: int) -> Record:
    """A record from ``src`` (:func:`send_record`), its tensors on the CPU."""
    box: list[dict[str, tuple[Any, ...]] | None] = [None]     # unpickled: send_record's header
    dist.recv_object_list(box, src=src, device=torch.device("cpu"))
    header = box[0]
    assert header is not None, "recv_object_list fills the box"
    out: Record = {}
    for k, (kind, *rest) in header.items():
        if kind == "object":
            out[k] = rest[0]
        else:
            shape, dtype = rest
            t = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
            dist.recv(t, src=src)
            out[k] = t
    return out


V = TypeVar("V")


def merge(records: list[dict[str, V]]) -> dict[str, V]:
    """One batch from several records (names are unique across them)."""
    out: dict[str, V] = {}
    for r in records:
        for k, v in r.items():
            prev = out.get(k)
            if k in out and not (isinstance(v, torch.Tensor) and isinstance(prev, torch.Tensor)
                                 and torch.equal(prev, v)):
                raise ValueError(f"records disagree on {k!r}")
            out[k] = v
    return out
