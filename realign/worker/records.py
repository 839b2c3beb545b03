"""Records: the data an MFC reads and writes, as named tensors, and how they move
between workers (point to point, never through the controller).

A record is a ``dict[str, Tensor | list]`` stored under a graph key (``seqs``,
``logprobs``, ``rewards``...). Sequences are right-padded ``tokens`` [b, s] with
``lengths`` [b] and ``prompt_lengths`` [b]; per-token log-probs are [b, s-1], where
position t scores token t+1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

Record = dict[str, object]


def sequences_from_generation(prompts: list[list[int]], gen_tokens: torch.Tensor,
                              gen_logprobs: torch.Tensor, gen_lengths: torch.Tensor,
                              pad_id: int) -> tuple[Record, Record]:
    """(``seqs`` record, ``logprobs`` record) from prompts and their continuations."""
    rows = [list(p) + gen_tokens[i, :int(gen_lengths[i])].tolist() for i, p in enumerate(prompts)]
    s = max(len(r) for r in rows)
    tokens = torch.full((len(rows), s), pad_id, dtype=torch.long)
    logprobs = torch.zeros(len(rows), s - 1, dtype=torch.float32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        n, p = int(gen_lengths[i]), len(prompts[i])
        logprobs[i, p - 1:p - 1 + n] = gen_logprobs[i, :n].float().cpu()
    seqs = {"tokens": tokens,
            "lengths": torch.tensor([len(r) for r in rows], dtype=torch.long),
            "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.long)}
    return seqs, {"logprobs": logprobs}


def send_record(rec: Record, dst: int) -> None:
    """Header (names, shapes, dtypes, non-tensor values) then each tensor."""
    header = {k: (("tensor", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor)
                  else ("object", v)) for k, v in rec.items()}
    dist.send_object_list([header], dst=dst)
    for k, v in rec.items():
        if isinstance(v, torch.Tensor):
            dist.send(v.contiguous(), dst=dst)


def recv_record(src: int, device: torch.device) -> Record:
    box = [None]
    dist.recv_object_list(box, src=src)
    out: Record = {}
    for k, (kind, *rest) in box[0].items():
        if kind == "object":
            out[k] = rest[0]
        else:
            shape, dtype = rest
            t = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")),
                            device=device)
            dist.recv(t, src=src)
            out[k] = t
    return out


def merge(records: list[Record]) -> Record:
    """One batch from several records (names are unique across them)."""
    out: Record = {}
    for r in records:
        for k, v in r.items():
            if k in out and not (isinstance(v, torch.Tensor) and torch.equal(out[k], v)):
                raise ValueError(f"records disagree on {k!r}")
            out[k] = v
    return out
