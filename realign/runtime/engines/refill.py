"""Generation that refills its slots: a sequence that has ended gives its KV-cache row
to the next waiting prompt instead of idling until its wave's longest has ended.

A data-parallel rank's prompts wait in one queue, in order. The plan's waves fix the
cache: ``g = min(waves, pp)`` slot groups (as many as waves in flight), each of
``ceil(rows / waves)`` slots (a wave's rows), of up to the longest prompt plus
``max_new_tokens`` positions; the same bytes as the waves in flight
(:func:`planner.cost.memory.kv_cache_bytes`). Each iteration of a group:

1. (stages other than the last) the tokens its last forward chose arrive from the last
   stage and are recorded, as in :mod:`~realign.runtime.engines.waves`;
2. slots whose sequence has ended are freed: at ``max_new_tokens`` at once, at a stop
   token on the next stop check (every :data:`STOP_CHECK_EVERY` iterations of the
   group: the check reads device values on the host, a CUDA synchronisation);
3. free slots take the next prompts of the queue, in order;
4. one prefill forward for the prompts just admitted (into their slots' cache rows),
   then one decode step for the slots that were already decoding, in the same
   iteration: the new sequences' first tokens and the others' next tokens are chosen
   together. Once no more than half the slots decode, the step runs those rows only
   (their cache rows gathered) rather than every slot.

Every stage walks the groups in the same order and takes the same decisions from the
same recorded tokens, so the point-to-point messages of
:class:`~realign.runtime.engines.waves.StageLinks` meet as in waves. A sequence's
tokens do not depend on its neighbours: the forward is row-independent and the sampling
noise is a function of (seed, sequence, position) (:mod:`realign.runtime.sampling`), so
greedy and sampled outputs are those of waves (tested against them).

The cost model prices this by its expected decode steps and admitting iterations
(:func:`planner.graph.refill.refill_shape`, :mod:`planner.cost.generate_terms`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.graph.lengths import STOP_CHECK_EVERY
from realign.data.collate import pad_right
from realign.runtime.engines.captured_step import CaptureMode, capture_steps, rows_bucket
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.engines.waves import NOISE_BLOCK, DecodeResult, StageLinks, wave_bounds
from realign.runtime.model import ModelShard
from realign.runtime.sampling import (
    SamplingParams,
    choose_tokens,
    gumbel_noise_hashed,
    position_hashes,
)


@dataclass
class _Outputs:
    """The rank's generated tokens, by prompt (local index) and generated position, plus
    a spare row and column that the slots holding no sequence write to (so every slot
    records in one vectorised write)."""

    tokens: torch.Tensor       #: [rows + 1, n + 1] long
    logprobs: torch.Tensor     #: [rows + 1, n + 1] float32
    lengths: torch.Tensor      #: [rows + 1] long


class _SlotGroup:
    """One group's slots: which prompt each holds (-1: free), how many tokens it has
    generated, whether it has produced a stop token; its KV cache. What decides
    admissions lives on the host (lists); what the forward and the records read, on the
    device (tensors), rebuilt only when a slot changes hands."""

    def __init__(self, shard: ModelShard, slots: int, max_len: int, spare: int,
                 capture: CaptureMode | None = None):
        dev = shard.device.device
        with torch.inference_mode(False):      # RoPE tables cached for training too
            self.dec = capture_steps(StageDecoder(shard, max_len, cache_rows=slots), capture)
        self.spare = spare                     #: the outputs' spare row
        self.row = [-1] * slots
        self.made = [0] * slots
        self.made_t = torch.zeros(slots, dtype=torch.long, device=dev)
        self.choice = torch.zeros(slots, dtype=torch.long, device=dev)
        self.every = torch.arange(slots, device=dev)
        self.new: list[int] = []       #: the slots admitted for the next forward
        self.iters = 0
        self.steps = 0                 #: forwards that ran a decode step
        self.ran = False               #: a forward ran since the last record
        self.noise: _SlotNoise | None = None
        #: records padding from now on: free, or its sequence has produced a stop token
        self.dead = torch.ones(slots, dtype=torch.bool, device=dev)
        self._changed(dev, [0] * slots)

    def _changed(self, dev, plen: list[int]) -> None:
        """Device copies of the slots' rows, prompt lengths and occupancy, and what
        each iteration derives from them."""
        self.row_t = torch.tensor([r if r >= 0 else self.spare for r in self.row], device=dev)
        self.plen_t = torch.tensor(plen, device=dev)
        self.busy = torch.tensor([r >= 0 for r in self.row], device=dev)
        self.busy_long = self.busy.long()
        #: a decoding slot's step feeds its newest token at ``pos_base + made``
        self.pos_base = torch.where(self.busy, self.plen_t - 1, 0)
        self.dead |= ~self.busy

    @property
    def slots(self) -> int:
        return len(self.row)

    @property
    def idle(self) -> bool:
        return all(r < 0 for r in self.row)

    def record(self, choice: torch.Tensor, logp: torch.Tensor, out: _Outputs,
               stops: torch.Tensor, pad_id: int) -> None:
        """The tokens ``choice`` [slots] of the last forward (every busy slot ran)."""
        if not self.ran:
            return
        # a busy slot writes its token ``made`` (< n); a free one the spare row
        at = (self.row_t, self.made_t)
        out.tokens[at] = torch.where(self.dead, pad_id, choice)
        out.logprobs[at] = torch.where(self.dead, 0.0, logp)
        out.lengths.index_add_(0, self.row_t, (~self.dead).long())
        self.dead |= torch.isin(choice, stops)
        self.choice = choice
        self.made_t += self.busy_long
        self.made = [m + (r >= 0) for m, r in zip(self.made, self.row)]
        self.ran = False

    def release_and_admit(self, queue: list[int], n: int, plen: list[int]) -> None:
        """Free the slots whose sequence ended (a stop token: on a stop check only);
        fill free slots from the front of ``queue`` (consumed)."""
        check = self.iters % STOP_CHECK_EVERY == 0
        stopped = self.dead.tolist() if check and not self.idle else None
        changed = False
        for s in range(self.slots):
            if self.row[s] >= 0 and (self.made[s] == n or (stopped and stopped[s])):
                self.row[s], changed = -1, True
        self.new = []
        for s in range(self.slots):
            if self.row[s] < 0 and queue:
                self.row[s], self.made[s] = queue.pop(0), 0
                self.new.append(s)
        if changed or self.new:
            dev = self.made_t.device
            self._changed(dev, [plen[r] if r >= 0 else 0 for r in self.row])
            if self.new:
                idx = torch.tensor(self.new, device=dev)
                self.made_t[idx] = 0
                self.dead[idx] = False


class _SlotNoise:
    """The sampling noise of each slot's sequence, made a block of its positions at a
    time (at most :data:`~realign.runtime.engines.waves.NOISE_BLOCK` values for the
    group) when the slot takes a sequence or leaves its block, rather than every step:
    the hashing is a dozen integer operations over [rows, vocabulary], as costly as a
    small model's forward."""

    def __init__(self, hashes: torch.Tensor, slots: int, vocab: int):
        self.hashes, self.vocab = hashes, vocab
        self.width = max(1, min(len(hashes), NOISE_BLOCK // max(1, slots * vocab)))
        dev = hashes.device
        self.block = torch.zeros(slots, self.width, vocab, dtype=torch.float64, device=dev)
        self.start = torch.zeros(slots, dtype=torch.long, device=dev)
        self.made_from = [0] * slots
        self.owner = [-1] * slots

    def at(self, grp: "_SlotGroup", first_index: int) -> torch.Tensor:
        """[slots, vocab] the noise of each slot's next token."""
        stale = [s for s in range(grp.slots) if grp.row[s] >= 0 and (
            self.owner[s] != grp.row[s]
            or not self.made_from[s] <= grp.made[s] < self.made_from[s] + self.width)]
        if stale:
            dev = self.start.device
            idx = torch.tensor(stale, device=dev)
            start = torch.tensor([grp.made[s] for s in stale], device=dev)
            pos = (start.unsqueeze(1) + torch.arange(self.width, device=dev)).clamp(
                max=len(self.hashes) - 1)
            ids = first_index + grp.row_t[idx]
            self.block[idx] = gumbel_noise_hashed(self.hashes[pos], ids.unsqueeze(1), self.vocab)
            self.start[idx] = start
            for s in stale:
                self.owner[s], self.made_from[s] = grp.row[s], grp.made[s]
        off = (grp.made_t - self.start).clamp(0, self.width - 1)
        return self.block[grp.every, off]


def decode_refill(shard: ModelShard, prompts: list[list[int]], p: SamplingParams,
                  first_index: int, waves: int, pad_id: int,
                  capture: CaptureMode | None = None) -> DecodeResult:
    """Generate for ``prompts`` (this DP rank's, global indices from ``first_index``) in
    slots that refill (module docs); every stage of the replica calls it alike and gets
    the whole result. ``capture``: how the groups' decode steps are captured and
    replayed (:mod:`~realign.runtime.engines.captured_step`; None: eager)."""
    g = shard.groups
    dev = shard.device.device
    n = p.max_new_tokens
    rows = len(prompts)
    bounds = wave_bounds(rows, waves)
    slots = bounds[0][1] - bounds[0][0]
    longest = max(len(q) for q in prompts)
    groups = [_SlotGroup(shard, slots, longest + n, rows, capture)
              for _ in range(min(len(bounds), g.layout.pp))]
    peak = sum(grp.dec.cache_bytes for grp in groups)
    hashes = None if p.greedy else position_hashes(p.seed, n, dev)
    if hashes is not None and g.is_last_stage:
        for grp in groups:
            grp.noise = _SlotNoise(hashes, slots, shard.spec.vocab_size)
    out = _Outputs(tokens=torch.full((rows + 1, n + 1), pad_id, dtype=torch.long, device=dev),
                   logprobs=torch.zeros(rows + 1, n + 1, device=dev),
                   lengths=torch.zeros(rows + 1, dtype=torch.long, device=dev))
    run = _Run(shard, prompts, [len(q) for q in prompts], p, first_index, pad_id,
               torch.tensor(list(p.stop_token_ids) or [-1], device=dev),
               StageLinks(shard), out)
    queue = list(range(rows))
    live = list(groups)
    while live:
        for grp in list(live):
            if not g.is_last_stage and grp.ran:
                grp.record(*run.links.recv_choice(grp.slots), out, run.stops, pad_id)
            grp.release_and_admit(queue, n, run.plen)
            if grp.idle:
                live.remove(grp)
                continue
            run.iterate(grp)
    run.links.wait_all()
    for grp in groups:
        del grp.dec                    # the caches go with their decoders
    return DecodeResult(out.tokens[:rows, :n], out.logprobs[:rows, :n], out.lengths[:rows], peak,
                        max(grp.steps for grp in groups))


@dataclass
class _Run:
    """What every iteration of a call reads."""

    shard: ModelShard
    prompts: list[list[int]]
    plen: list[int]
    p: SamplingParams
    first_index: int
    pad_id: int
    stops: torch.Tensor
    links: StageLinks
    out: _Outputs

    def iterate(self, grp: _SlotGroup) -> None:
        """One forward of the group on this stage: the admitted prompts' prefill, then
        the decoding slots' step; the last stage chooses, records and sends the tokens."""
        g, links = self.shard.groups, self.links
        dev = self.shard.device.device
        last = g.is_last_stage
        new = grp.new
        going = [s for s in range(grp.slots) if grp.row[s] >= 0 and s not in new]
        logits_new = logits_going = None
        if new:
            tokens, lengths = pad_right([self.prompts[grp.row[s]] for s in new], self.pad_id)
            x = (tokens.to(dev) if g.is_first_stage
                 else links.recv_hidden(len(new), tokens.shape[1]))
            h = grp.dec.prefill(x, lengths.to(dev), rows=torch.tensor(new, device=dev))
            if last:
                logits_new = h
            else:
                links.send_hidden(h)
        every = 2 * len(going) > grp.slots
        if going:
            kv_len = max(self.plen[grp.row[s]] + grp.made[s] for s in going)
            if every:
                # a free or just-admitted slot writes a cache entry its own next forward
                # overwrites before attending to it (its prompt's end; a free slot's
                # stale position)
                pos = grp.pos_base + grp.made_t
                if new:
                    pos = torch.where(grp.made_t == 0, grp.plen_t, pos)
                x = grp.choice.unsqueeze(1)
                rows = None
            else:
                rows = torch.tensor(going + self._padding(grp, going), device=dev)
                pos = grp.plen_t[rows] + grp.made_t[rows] - 1
                if rows.shape[0] > len(going):
                    pos[len(going):] = grp.plen_t[rows[len(going):]]
                x = grp.choice[rows].unsqueeze(1)
            if not g.is_first_stage:
                x = links.recv_hidden(x.shape[0], 1)
            h = grp.dec.step(x, pos, kv_len, rows=rows)
            grp.steps += 1
            if last:
                logits_going = h if every else h[:len(going)]    # not the padding
            else:
                links.send_hidden(h)
        grp.ran = True
        grp.iters += 1
        if not last:
            return
        choice = torch.zeros(grp.slots, dtype=torch.long, device=dev)
        logp = torch.zeros(grp.slots, device=dev)
        noise = grp.noise.at(grp, self.first_index) if grp.noise is not None else None
        if logits_going is not None:
            at = None if every else torch.tensor(going, device=dev)
            c, lp = self._choose(logits_going, grp, at, noise)
            if at is None:
                choice, logp = c, lp
            else:
                choice[at], logp[at] = c, lp
        if logits_new is not None:
            at = torch.tensor(new, device=dev)
            c, lp = self._choose(logits_new, grp, at, noise)
            choice[at], logp[at] = c, lp
        grp.record(choice, logp, self.out, self.stops, self.pad_id)
        if g.layout.pp > 1:
            links.send_choice(choice, logp)

    @staticmethod
    def _padding(grp: _SlotGroup, going: list[int]) -> list[int]:
        """Slots that fill a captured step's rows up to its bucket
        (:func:`~realign.runtime.engines.captured_step.rows_bucket`; none for an eager
        step): slots not decoding, at their prompt's length, where a just-admitted slot's
        own next step writes before it attends and a free slot's next prefill writes."""
        if grp.dec.replay is None:
            return []
        extra = rows_bucket(len(going), grp.slots) - len(going)
        return [s for s in range(grp.slots) if s not in going][:extra]

    def _choose(self, logits: torch.Tensor, grp: _SlotGroup, at: torch.Tensor | None,
                noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The token of each slot in ``at`` (None: every slot) at its own generated
        position (``noise``: every slot's, None when greedy), and its log-prob."""
        logits = logits.float()[:, :self.shard.spec.vocab_size]
        ids = self.first_index + (grp.row_t if at is None else grp.row_t[at])
        if noise is not None and at is not None:
            noise = noise[at]
        choice = choose_tokens(logits, self.p, ids, 0, noise)
        return choice, logits.log_softmax(-1).gather(1, choice.unsqueeze(1)).squeeze(1)
