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
:class:`~realign.runtime.engines.waves._StageLinks` meet as in waves. A sequence's
tokens do not depend on its neighbours: the forward is row-independent and the sampling
noise is a function of (seed, sequence, position) (:mod:`realign.runtime.sampling`), so
greedy and sampled outputs are those of waves (tested against them).

The cost model prices this by its expected decode steps
(:func:`planner.graph.lengths.refill_steps`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.graph.lengths import STOP_CHECK_EVERY
from realign.data.collate import pad_right
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.engines.waves import DecodeResult, _StageLinks, wave_bounds
from realign.runtime.model import ModelShard
from realign.runtime.sampling import SamplingParams, choose_tokens, gumbel_noise_rows


@dataclass
class _Outputs:
    """The rank's generated tokens, by prompt (local index) and generated position."""

    tokens: torch.Tensor       #: [rows, n] long
    logprobs: torch.Tensor     #: [rows, n] float32
    lengths: torch.Tensor      #: [rows] long


class _SlotGroup:
    """One group's slots: which prompt each holds (-1: free), how many tokens it has
    generated, whether it has produced a stop token; its KV cache."""

    def __init__(self, shard: ModelShard, slots: int, max_len: int):
        dev = shard.device.device
        with torch.inference_mode(False):      # RoPE tables cached for training too
            self.dec = StageDecoder(shard, max_len, cache_rows=slots)
        self.row = [-1] * slots
        self.made = [0] * slots
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.choice = torch.zeros(slots, dtype=torch.long, device=dev)
        self.ran: list[int] = []       #: the slots of the last forward (in slot order)
        self.new: list[int] = []       #: the slots admitted for the next forward
        self.iters = 0
        self.steps = 0                 #: forwards that ran a decode step

    @property
    def slots(self) -> int:
        return len(self.row)

    @property
    def idle(self) -> bool:
        return all(r < 0 for r in self.row)

    def record(self, choice: torch.Tensor, logp: torch.Tensor, out: _Outputs,
               stops: torch.Tensor, pad_id: int) -> None:
        """The tokens ``choice`` [slots] of the last forward's slots."""
        if not self.ran:
            return
        dev = choice.device
        at = torch.tensor(self.ran, device=dev)
        rows = torch.tensor([self.row[s] for s in self.ran], device=dev)
        made = torch.tensor([self.made[s] for s in self.ran], device=dev)
        live = ~self.stopped[at]
        c = choice[at]
        out.tokens[rows, made] = torch.where(live, c, pad_id)
        out.logprobs[rows, made] = torch.where(live, logp[at], 0.0)
        out.lengths[rows] += live.long()
        self.stopped[at] |= torch.isin(c, stops)
        self.choice[at] = c
        for s in self.ran:
            self.made[s] += 1

    def release_and_admit(self, queue: list[int], n: int) -> None:
        """Free the slots whose sequence ended (a stop token: on a stop check only);
        fill free slots from the front of ``queue`` (consumed)."""
        check = self.iters % STOP_CHECK_EVERY == 0
        stopped = self.stopped.tolist() if check and not self.idle else None
        for s in range(self.slots):
            if self.row[s] >= 0 and (self.made[s] == n or (stopped and stopped[s])):
                self.row[s] = -1
        self.new = []
        for s in range(self.slots):
            if self.row[s] < 0 and queue:
                self.row[s], self.made[s] = queue.pop(0), 0
                self.stopped[s] = False
                self.new.append(s)


def decode_refill(shard: ModelShard, prompts: list[list[int]], p: SamplingParams,
                  first_index: int, waves: int, pad_id: int) -> DecodeResult:
    """Generate for ``prompts`` (this DP rank's, global indices from ``first_index``) in
    slots that refill (module docs); every stage of the replica calls it alike and gets
    the whole result."""
    g = shard.groups
    dev = shard.device.device
    n = p.max_new_tokens
    bounds = wave_bounds(len(prompts), waves)
    slots = bounds[0][1] - bounds[0][0]
    longest = max(len(q) for q in prompts)
    groups = [_SlotGroup(shard, slots, longest + n)
              for _ in range(min(len(bounds), g.layout.pp))]
    peak = sum(grp.dec.cache_bytes for grp in groups)
    out = _Outputs(tokens=torch.full((len(prompts), n), pad_id, dtype=torch.long, device=dev),
                   logprobs=torch.zeros(len(prompts), n, device=dev),
                   lengths=torch.zeros(len(prompts), dtype=torch.long, device=dev))
    stops = torch.tensor(list(p.stop_token_ids) or [-1], device=dev)
    plen = [len(q) for q in prompts]
    queue = list(range(len(prompts)))
    links = _StageLinks(shard)
    live = list(groups)
    while live:
        for grp in list(live):
            if not g.is_last_stage and grp.ran:
                grp.record(*links.recv_choice(grp.slots), out, stops, pad_id)
            grp.release_and_admit(queue, n)
            if grp.idle:
                live.remove(grp)
                continue
            _iterate(shard, grp, prompts, plen, p, first_index, links, out, stops, pad_id)
    links.wait_all()
    for grp in groups:
        grp.dec = None                 # the caches go with their decoders
    return DecodeResult(out.tokens, out.logprobs, out.lengths, peak,
                        max(grp.steps for grp in groups))


def _iterate(shard: ModelShard, grp: _SlotGroup, prompts: list[list[int]], plen: list[int],
             p: SamplingParams, first_index: int, links: _StageLinks, out: _Outputs,
             stops: torch.Tensor, pad_id: int) -> None:
    """One forward of the group on this stage: the admitted prompts' prefill, then the
    decoding slots' step; the last stage chooses, records and sends the tokens."""
    g = shard.groups
    dev = shard.device.device
    last = g.is_last_stage
    new = grp.new
    going = [s for s in range(grp.slots) if grp.row[s] >= 0 and s not in new]
    logits_new = logits_going = None
    if new:
        tokens, lengths = pad_right([prompts[grp.row[s]] for s in new], pad_id)
        x = (tokens.to(dev) if g.is_first_stage
             else links.recv_hidden(len(new), tokens.shape[1]))
        h = grp.dec.prefill(x, lengths.to(dev), rows=torch.tensor(new, device=dev))
        if last:
            logits_new = h
        else:
            links.send_hidden(h)
    if going:
        every = 2 * len(going) > grp.slots
        at = list(range(grp.slots)) if every else going
        # a free or just-admitted slot in a whole-group step writes a cache entry its
        # own next forward overwrites before attending to it (its prompt's end, or 0)
        pos = [plen[grp.row[s]] + grp.made[s] - 1 if s in going
               else (plen[grp.row[s]] if grp.row[s] >= 0 else 0) for s in at]
        rows = None if every else torch.tensor(at, device=dev)
        x = (grp.choice[at].unsqueeze(1) if g.is_first_stage
             else links.recv_hidden(len(at), 1))
        h = grp.dec.step(x, torch.tensor(pos, device=dev), max(pos) + 1, rows=rows)
        grp.steps += 1
        if last:
            logits_going = h if not every else h[torch.tensor(going, device=dev)]
        else:
            links.send_hidden(h)
    grp.ran = sorted(new + going)
    grp.iters += 1
    if not last:
        return
    choice = torch.zeros(grp.slots, dtype=torch.long, device=dev)
    logp = torch.zeros(grp.slots, device=dev)
    for slots_, logits in ((new, logits_new), (going, logits_going)):
        if slots_:
            c, lp = _choose(shard, logits, p, [first_index + grp.row[s] for s in slots_],
                            [grp.made[s] for s in slots_])
            at = torch.tensor(slots_, device=dev)
            choice[at], logp[at] = c, lp
    grp.record(choice, logp, out, stops, pad_id)
    if g.layout.pp > 1:
        links.send_choice(choice, logp)


def _choose(shard: ModelShard, logits: torch.Tensor, p: SamplingParams, seq_ids: list[int],
            positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token at its own generated position and its log-prob."""
    logits = logits.float()[:, : shard.spec.vocab_size]
    ids = torch.tensor(seq_ids, device=logits.device)
    noise = (None if p.greedy
             else gumbel_noise_rows(p.seed, ids, positions, shard.spec.vocab_size))
    choice = choose_tokens(logits, p, ids, 0, noise)
    logp = logits.log_softmax(-1).gather(1, choice.unsqueeze(1)).squeeze(1)
    return choice, logp
