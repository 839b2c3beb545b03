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

What an iteration costs besides the model's forward is kept to a few tensor operations,
as in the refilling generation whose decode step the planner prices: the slots' newest
tokens and positions live in tensors written once per iteration (not rebuilt from the
samples' token lists); the decode step runs every slot's cache row in place once more
than half of them decode (a slot that is free or was just prefilled writes a cache
entry its own next forward overwrites before attending to it), and gathers the busy
rows otherwise; the sampling noise is made a block of positions per slot at a time
(:class:`_SlotNoise`) rather than hashed over the vocabulary every iteration.

One pipeline stage (``pp == 1``) and the replica's ranks calling it alike (TP ranks
compute the same logits).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from realign.data.collate import pad_right
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.engines.waves import NOISE_BLOCK
from realign.runtime.model import ModelShard
from realign.runtime.sampling import (
    SamplingParams,
    choose_tokens,
    gumbel_noise_hashed,
    position_hashes,
)


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
                 p: SamplingParams, greedy: Callable[[int], bool] | None = None):
        """``greedy``: the samples (by index) whose tokens are chosen greedily whatever
        ``p`` says (ReMax's baseline response, one slot of each group)."""
        assert shard.groups.layout.pp == 1, "streaming generation runs one stage"
        self.shard, self.p, self.greedy = shard, p, greedy
        self.n = p.max_new_tokens
        self.max_prompt_len = max_prompt_len
        with torch.inference_mode(False):      # RoPE tables cached for training too
            self.dec = StageDecoder(shard, max_prompt_len + self.n, cache_rows=slots)
        self.slot: list[StreamedSample | None] = [None] * slots
        self.fresh: list[int] = []             #: slots admitted, not yet prefilled
        self.stops = set(p.stop_token_ids)
        self.dev = dev = shard.device.device
        #: each slot's newest token and the position the next step feeds it at (a free
        #: slot: token 0 at position 0, which its next prefill overwrites)
        self.last = torch.zeros(slots, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)
        self.noise = (None if p.greedy
                      else _SlotNoise(position_hashes(p.seed, self.n, dev), slots,
                                      shard.spec.vocab_size))

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
        # an every-row step of the iteration that prefills it writes here: the position
        # its first token is fed at, which that token's own step overwrites
        self.pos[s] = len(sample.prompt)

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
        going = [s for s, x in enumerate(self.slot) if x is not None and x.tokens]
        slots: list[int] = []
        parts: list[torch.Tensor] = []
        if new:
            parts.append(self._prefill(new, [self._at(s).prompt for s in new]))
            slots += new
        if going:
            kv_len = max(len(q.prompt) + len(q.tokens) for q in map(self._at, going))
            with torch.inference_mode():
                if 2 * len(going) > len(self.slot):     # every row, in place
                    logits = self.dec.step(self.last.unsqueeze(1), self.pos, kv_len)
                    parts.append(logits[torch.tensor(going, device=self.dev)]
                                 if len(going) < len(self.slot) else logits)
                else:
                    rows = torch.tensor(going, device=self.dev)
                    parts.append(self.dec.step(self.last[rows].unsqueeze(1), self.pos[rows],
                                               kv_len, rows=rows))
            slots += going
        if not slots:
            return []
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        choice, logp = self._choose(slots, logits)
        at = torch.tensor(slots, device=self.dev)
        self.last[at] = choice
        ended: list[tuple[int, StreamedSample]] = []
        pos = []
        for s, tok, lp in zip(slots, choice.tolist(), logp.tolist()):
            q = self.slot[s]
            assert q is not None
            q.tokens.append(tok)
            q.logprobs.append(lp)
            q.versions.append(version)
            if tok in self.stops or len(q.tokens) >= self.n:
                ended.append((s, q))
                self.slot[s] = None
                pos.append(0)
            else:
                pos.append(len(q.prompt) + len(q.tokens) - 1)
        self.pos[at] = torch.tensor(pos, device=self.dev)
        return [q for _, q in sorted(ended, key=lambda e: e[0])]

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
        for s, q in enumerate(self.slot):       # the slots' tensors, from their samples
            self.last[s] = q.tokens[-1] if q is not None and q.tokens else 0
            self.pos[s] = (0 if q is None else
                           len(q.prompt) + len(q.tokens) - 1 if q.tokens else len(q.prompt))

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

    def _choose(self, slots: list[int], logits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's next token and its log-prob (the model's own distribution)."""
        logits = logits.float()[:, :self.shard.spec.vocab_size]
        seqs = [self._at(s) for s in slots]
        ids = torch.tensor([q.sample for q in seqs], device=self.dev)
        noise = None
        if self.noise is not None:
            noise = self.noise.at(slots, [q.sample for q in seqs], [len(q.tokens) for q in seqs])
        choice = choose_tokens(logits, self.p, ids, 0, noise)
        if self.greedy is not None:
            rows = [j for j, q in enumerate(seqs) if self.greedy(q.sample)]
            if rows:
                at = torch.tensor(rows, device=self.dev)
                choice[at] = logits[at].argmax(dim=-1)
        logp = logits.log_softmax(-1).gather(1, choice.unsqueeze(1)).squeeze(1)
        return choice, logp


class _SlotNoise:
    """The sampling noise of each slot's sample, made a block of its positions at a time
    (at most :data:`~realign.runtime.engines.waves.NOISE_BLOCK` values for all slots)
    when the slot takes a sample or leaves its block: the same values as
    :func:`~realign.runtime.sampling.gumbel_noise_rows` of each sample at its position
    (a function of (seed, sample, position) only), without hashing over the vocabulary
    every iteration (as costly as a small model's forward)."""

    def __init__(self, hashes: torch.Tensor, slots: int, vocab: int):
        self.hashes, self.vocab = hashes, vocab
        self.width = max(1, min(len(hashes), NOISE_BLOCK // max(1, slots * vocab)))
        dev = hashes.device
        self.block = torch.zeros(slots, self.width, vocab, dtype=torch.float64, device=dev)
        self.owner = [-1] * slots               #: the sample whose block a slot holds
        self.start = [0] * slots                #: the block's first position

    def at(self, slots: list[int], samples: list[int], made: list[int]) -> torch.Tensor:
        """[len(slots), vocab]: the noise of sample ``samples[j]``'s token ``made[j]``,
        held by slot ``slots[j]``."""
        stale = [j for j, s in enumerate(slots) if self.owner[s] != samples[j]
                 or not self.start[s] <= made[j] < self.start[s] + self.width]
        dev = self.block.device
        if stale:
            idx = torch.tensor([slots[j] for j in stale], device=dev)
            start = torch.tensor([made[j] for j in stale], device=dev)
            pos = (start.unsqueeze(1) + torch.arange(self.width, device=dev)).clamp(
                max=len(self.hashes) - 1)
            ids = torch.tensor([samples[j] for j in stale], device=dev)
            self.block[idx] = gumbel_noise_hashed(self.hashes[pos], ids.unsqueeze(1),
                                                  self.vocab)
            for j in stale:
                self.owner[slots[j]], self.start[slots[j]] = samples[j], made[j]
        off = [m - self.start[s] for s, m in zip(slots, made)]
        return self.block[torch.tensor(slots, device=dev), torch.tensor(off, device=dev)]
