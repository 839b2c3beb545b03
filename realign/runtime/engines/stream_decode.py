"""Streaming generation (``rollout.mode: streaming``): a KV cache of ``slots`` rows that
decodes one iteration at a time, driven from outside by the stream's schedule
(:class:`planner.graph.streaming.StreamSchedule`'s online form): the schedule says which
samples take a free slot, the decoder runs the iteration and says which samples ended.
New weights may arrive between two iterations (they are written into the replica's
parameters in place, which the decoder reads); with ``rollout.on_update: continue``
:meth:`StreamDecoder.recompute` rebuilds the cache rows of the sequences in flight from
their tokens under the new weights, so they continue as if they had been generated
under them from the start, while each token already made keeps the policy version and
behaviour log-prob it was made with.

One iteration (:meth:`StreamDecoder.iterate`): the samples admitted since the last one
are prefilled into their slots (their first token chosen from the prefill's logits),
the slots that were already decoding take one decode step; the chosen token of each
busy slot is recorded with its log-prob and the version. A sample ends at a stop token
or at ``max_new_tokens``. Tokens are chosen as in :mod:`~realign.runtime.engines.refill`
(greedy, or Gumbel noise that is a function of (seed, sample index, position)), so a
sample's tokens do not depend on which slot or iteration it ran in: without updates,
the streamed tokens are those of the ordinary refilling generation (tested).

One pipeline stage (``pp == 1``) and the replica's ranks calling it alike (TP ranks
compute the same logits).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from realign.data.collate import pad_right
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.model import ModelShard
from realign.runtime.sampling import SamplingParams, choose_tokens, gumbel_noise_rows


@dataclass
class StreamedSample:
    """One sample's generation so far (or ended)."""

    sample: int                            #: its index in data order (the noise's id)
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)     #: behaviour log-probs
    versions: list[int] = field(default_factory=list)       #: each token's policy version

    def state(self) -> list:
        return [self.sample, self.prompt, self.tokens, self.logprobs, self.versions]

    @classmethod
    def from_state(cls, st: list) -> StreamedSample:
        return cls(int(st[0]), list(st[1]), list(st[2]), list(st[3]), list(st[4]))


class StreamDecoder:
    """``slots`` cache rows of up to ``max_prompt_len + p.max_new_tokens`` positions."""

    def __init__(self, shard: ModelShard, slots: int, max_prompt_len: int,
                 p: SamplingParams):
        assert shard.groups.layout.pp == 1, "streaming generation runs one stage"
        self.shard, self.p = shard, p
        self.n = p.max_new_tokens
        self.max_prompt_len = max_prompt_len
        with torch.inference_mode(False):      # RoPE tables cached for training too
            self.dec = StageDecoder(shard, max_prompt_len + self.n, cache_rows=slots)
        self.slot: list[StreamedSample | None] = [None] * slots
        self.fresh: list[int] = []             #: slots admitted, not yet prefilled
        self.stops = set(p.stop_token_ids)
        self.dev = shard.device.device

    @property
    def busy(self) -> int:
        return sum(s is not None for s in self.slot)

    def admit(self, sample: StreamedSample) -> None:
        """``sample`` (no tokens yet) takes the first free slot; prefilled at the next
        iteration."""
        assert not sample.tokens, "a sample in flight comes back with load()"
        if len(sample.prompt) > self.max_prompt_len:
            raise ValueError(f"a prompt of {len(sample.prompt)} tokens is longer than "
                             f"the stream's {self.max_prompt_len}")
        s = self.slot.index(None)
        self.slot[s] = sample
        self.fresh.append(s)

    def recompute(self) -> None:
        """Rebuild the cache rows of every sequence in flight from its prompt and the
        tokens it made (all but the newest, which the next step feeds) under the
        replica's current weights (``rollout.on_update: continue``)."""
        going = [s for s, x in enumerate(self.slot) if x is not None and x.tokens]
        if not going:
            return
        self._prefill(going, [self._seq(s)[:-1] for s in going])

    def iterate(self, version: int) -> list[StreamedSample]:
        """One iteration (module docs); the samples that ended, their slots freed."""
        new, self.fresh = self.fresh, []
        going = [s for s, x in enumerate(self.slot) if x is not None and s not in new]
        chosen: dict[int, tuple[int, float]] = {}
        if new:
            logits = self._prefill(new, [self._at(s).prompt for s in new])
            chosen.update(self._choose(new, logits))
        if going:
            rows = torch.tensor(going, device=self.dev)
            seqs = [self._at(s) for s in going]
            x = torch.tensor([[q.tokens[-1]] for q in seqs], device=self.dev)
            pos = torch.tensor([len(q.prompt) + len(q.tokens) - 1 for q in seqs],
                               device=self.dev)
            with torch.inference_mode():
                logits = self.dec.step(x, pos, int(pos.max()) + 1, rows=rows)
            chosen.update(self._choose(going, logits))
        ended = []
        for s, (tok, lp) in sorted(chosen.items()):
            q = self.slot[s]
            assert q is not None
            q.tokens.append(tok)
            q.logprobs.append(lp)
            q.versions.append(version)
            if tok in self.stops or len(q.tokens) >= self.n:
                ended.append(q)
                self.slot[s] = None
        return ended

    def in_flight(self) -> list[StreamedSample]:
        """The samples in the slots, by slot."""
        return [x for x in self.slot if x is not None]

    # ---- checkpoints -----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The slots (their samples, by slot), those admitted and not yet prefilled, and
        the cache itself, so a resumed stream continues bit for bit (a cache rebuilt
        from the tokens would round differently from the one built step by step)."""
        return {"slots": [None if q is None else q.state() for q in self.slot],
                "fresh": list(self.fresh),
                "k": [t.cpu().clone() for t in self.dec.k],
                "v": [t.cpu().clone() for t in self.dec.v]}

    def load(self, st: dict[str, Any]) -> None:
        """Back to :meth:`state` (a decoder of the same slots and lengths)."""
        assert len(st["slots"]) == len(self.slot), "a stream of other slots"
        self.slot = [None if q is None else StreamedSample.from_state(q) for q in st["slots"]]
        self.fresh = list(st["fresh"])
        for mine, saved in zip(self.dec.k + self.dec.v, st["k"] + st["v"]):
            mine.copy_(saved)

    # ---- helpers ---------------------------------------------------------------------
    def _at(self, s: int) -> StreamedSample:
        q = self.slot[s]
        assert q is not None, f"slot {s} is free"
        return q

    def _seq(self, s: int) -> list[int]:
        q = self._at(s)
        return q.prompt + q.tokens

    def _prefill(self, slots: list[int], seqs: list[list[int]]) -> torch.Tensor:
        tokens, lengths = pad_right(seqs, 0)
        with torch.inference_mode():
            return self.dec.prefill(tokens.to(self.dev), lengths.to(self.dev),
                                    rows=torch.tensor(slots, device=self.dev))

    def _choose(self, slots: list[int], logits: torch.Tensor) -> dict[int, tuple[int, float]]:
        """Each slot's next token and its log-prob (the model's own distribution)."""
        logits = logits.float()[:, :self.shard.spec.vocab_size]
        seqs = [self._at(s) for s in slots]
        ids = torch.tensor([q.sample for q in seqs], device=self.dev)
        noise = None
        if not self.p.greedy:
            noise = gumbel_noise_rows(self.p.seed, ids, [len(q.tokens) for q in seqs],
                                      logits.shape[-1])
        choice = choose_tokens(logits, self.p, ids, 0, noise)
        logp = logits.log_softmax(-1).gather(1, choice.unsqueeze(1)).squeeze(1)
        return {s: (int(c), float(lp)) for s, c, lp in zip(slots, choice.tolist(), logp.tolist())}
