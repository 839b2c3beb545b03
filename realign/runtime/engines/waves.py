"""Generation in waves: a generate call's micro-batches, as the plan prices them.

A data-parallel rank's prompts are split into ``waves`` contiguous waves. Each wave
has its own KV cache, allocated when the wave starts and freed when it ends, so the
cache holds the waves in flight only. ``g = min(waves, pp)`` waves are in flight
together, pipelined over the stages: while the last stage picks a wave's next token,
the first stage already runs the next wave's step. Groups of ``g`` waves run one after
another. With pp = 1 the waves simply run in turn. (The cost model prices exactly
this: :meth:`planner.cost.cost_model.CostModel.kv_cache_bytes` and its generate terms.)

The pipeline is point to point, never collective, so stages do not wait for each other
more than the data requires: stage ``s`` sends a wave's hidden states to ``s + 1``; the
last stage picks the tokens and sends them (with their log-probs) to every other
stage, which reads them when it comes to that wave's next step: the first stage feeds
them in, and every stage learns from them when the wave has ended. Every stage walks
the waves in the same order (step by step, wave by wave, skipping ended waves), so
each receive meets its send. Sends are asynchronous and completed at the group's end.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from planner.graph.lengths import STOP_CHECK_EVERY
from realign.data.collate import contiguous_ranges, pad_right
from realign.runtime.engines.captured_step import CaptureMode, capture_steps
from realign.runtime.engines.decoder import StageDecoder
from realign.runtime.model import ModelShard
from realign.runtime.sampling import SamplingParams, choose_tokens, gumbel_noise

#: float64 noise values drawn per computation (positions x rows x vocabulary): 32 MB
NOISE_BLOCK = 1 << 22


def wave_bounds(n: int, waves: int) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` of each of ``waves`` contiguous waves over ``n`` rows
    (:func:`realign.data.collate.contiguous_ranges`)."""
    return contiguous_ranges(n, waves)


@dataclass
class DecodeResult:
    tokens: torch.Tensor       #: [b, n] long, pad after the end
    logprobs: torch.Tensor     #: [b, n] float32, 0 after the end
    lengths: torch.Tensor      #: [b] long
    kv_cache_peak_bytes: int   #: the most KV-cache bytes this rank held at once
    #: decode iterations (a step of every wave or slot group in flight), summed over
    #: the groups that run one after another: what the planner prices per group
    decode_steps: int = 0


class _NoiseBlocks:
    """The sampling noise of the generated positions, made a block of positions at a
    time (at most :data:`NOISE_BLOCK` values) rather than once per position."""

    def __init__(self, p: SamplingParams, seq_ids: torch.Tensor, n: int, vocab: int):
        self.p, self.seq_ids, self.n, self.vocab = p, seq_ids, n, vocab
        self.per_block = max(1, NOISE_BLOCK // max(1, seq_ids.shape[0] * vocab))
        self.start = 0
        self.block: torch.Tensor | None = None

    def at(self, t: int) -> torch.Tensor | None:
        """Noise [b, vocab] of position ``t`` (None when greedy)."""
        if self.p.greedy:
            return None
        if self.block is None or not self.start <= t < self.start + self.block.shape[0]:
            self.start = t
            end = min(self.n, t + self.per_block)
            self.block = gumbel_noise(self.p.seed, self.seq_ids, range(t, end), self.vocab)
        return self.block[t - self.start]


@dataclass
class _Wave:
    """One wave's state on this stage."""

    tokens: torch.Tensor           #: [b, P] right-padded prompts
    plen: torch.Tensor             #: [b] prompt lengths
    dec: StageDecoder              #: its KV cache
    seq_ids: torch.Tensor          #: [b] global sequence indices (sampling noise)
    noise: _NoiseBlocks
    pos: torch.Tensor              #: [b] where the next token goes
    out_tok: torch.Tensor
    out_lp: torch.Tensor
    out_len: torch.Tensor
    done: torch.Tensor
    choice: torch.Tensor | None = None      #: the tokens chosen last
    finished: bool = False

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def longest(self) -> int:
        return self.tokens.shape[1]

    def record(self, t: int, choice: torch.Tensor, logp: torch.Tensor, stops: torch.Tensor,
               pad_id: int, n: int) -> None:
        """Token ``t`` of every row (rows that ended keep padding); the wave ends after
        ``n`` tokens, or at a stop check (every :data:`STOP_CHECK_EVERY` tokens) once
        every row has produced a stop token."""
        live = ~self.done
        self.out_tok[:, t] = torch.where(live, choice, pad_id)
        self.out_lp[:, t] = torch.where(live, logp, 0.0)
        self.out_len += live.long()
        self.done |= torch.isin(choice, stops)
        self.choice = choice
        self.finished = t + 1 == n or ((t + 1) % STOP_CHECK_EVERY == 0
                                       and bool(self.done.all()))


@dataclass
class StageLinks:
    """The point-to-point traffic of one pipeline stage (world ranks of its peers)."""

    shard: ModelShard
    pending: list = field(default_factory=list)     #: (work, tensor) of unfinished sends

    def _rank(self, pp_rank: int) -> int:
        g = self.shard.groups
        return g.world_rank(g.tp_rank, g.dp_rank, pp_rank)

    def _isend(self, t: torch.Tensor, dst: int) -> None:
        self.pending.append((dist.isend(t, dst=dst), t))
        self.pending = [(w, x) for w, x in self.pending if not w.is_completed()]

    def send_hidden(self, h: torch.Tensor) -> None:
        self._isend(h.contiguous(), self._rank(self.shard.groups.pp_rank + 1))

    def recv_hidden(self, rows: int, positions: int) -> torch.Tensor:
        s = self.shard
        x = torch.empty(rows, positions, s.spec.hidden, dtype=s.device.dtype,
                        device=s.device.device)
        dist.recv(x, src=self._rank(s.groups.pp_rank - 1))
        return x

    def send_choice(self, choice: torch.Tensor, logp: torch.Tensor) -> None:
        packed = torch.stack([choice.double(), logp.double()])
        for stage in range(self.shard.groups.layout.pp - 1):
            self._isend(packed, self._rank(stage))

    def recv_choice(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.empty(2, rows, dtype=torch.float64, device=self.shard.device.device)
        dist.recv(packed, src=self._rank(self.shard.groups.layout.pp - 1))
        return packed[0].long(), packed[1].float()

    def wait_all(self) -> None:
        for w, _ in self.pending:
            w.wait()
        self.pending = []


def decode_waves(shard: ModelShard, prompts: list[list[int]], p: SamplingParams,
                 first_index: int, waves: int, pad_id: int,
                 capture: CaptureMode | None = None) -> DecodeResult:
    """Generate for ``prompts`` (this DP rank's, global indices from ``first_index``) in
    ``waves`` waves; every stage of the replica calls it alike and gets the whole result.
    ``capture``: how each wave's decode steps are captured and replayed
    (:mod:`~realign.runtime.engines.captured_step`; None: eager)."""
    g = shard.groups
    dev = shard.device.device
    bounds = wave_bounds(len(prompts), waves)
    in_flight = min(len(bounds), g.layout.pp)
    stops = torch.tensor(list(p.stop_token_ids) or [-1], device=dev)
    done_waves: list[_Wave] = []
    peak = steps = 0
    for k in range(0, len(bounds), in_flight):
        group = [_new_wave(shard, prompts, lo, hi, p, first_index, pad_id, capture)
                 for lo, hi in bounds[k:k + in_flight]]
        peak = max(peak, sum(w.dec.cache_bytes for w in group))
        steps += _run_group(shard, group, p, stops, pad_id)
        for w in group:
            del w.dec                      # the wave's KV cache goes with its decoder
        done_waves += group
    return DecodeResult(torch.cat([w.out_tok for w in done_waves]),
                        torch.cat([w.out_lp for w in done_waves]),
                        torch.cat([w.out_len for w in done_waves]), peak, steps)


def _new_wave(shard: ModelShard, prompts, lo: int, hi: int, p: SamplingParams,
              first_index: int, pad_id: int, capture: CaptureMode | None) -> _Wave:
    dev = shard.device.device
    n = p.max_new_tokens
    tokens, plen = pad_right(prompts[lo:hi], pad_id)
    b = hi - lo
    # the RoPE tables made here are cached (on the shard, in megatron) for training
    # forwards too: keep them ordinary tensors
    with torch.inference_mode(False):
        dec = capture_steps(StageDecoder(shard, tokens.shape[1] + n, cache_rows=b), capture)
    seq_ids = torch.arange(first_index + lo, first_index + hi, device=dev)
    return _Wave(tokens=tokens.to(dev), plen=plen.to(dev), dec=dec, seq_ids=seq_ids,
                 noise=_NoiseBlocks(p, seq_ids, n, shard.spec.vocab_size),
                 pos=plen.to(dev).clone(),
                 out_tok=torch.full((b, n), pad_id, dtype=torch.long, device=dev),
                 out_lp=torch.zeros(b, n, device=dev),
                 out_len=torch.zeros(b, dtype=torch.long, device=dev),
                 done=torch.zeros(b, dtype=torch.bool, device=dev))


def _run_group(shard: ModelShard, group: list[_Wave], p: SamplingParams,
               stops: torch.Tensor, pad_id: int) -> int:
    """Decode a group of waves to their ends, pipelined over the stages; returns the
    decode iterations it ran.

    Iteration ``t`` runs, for each wave not yet ended, the forward that yields token
    ``t`` (the prefill at ``t = 0``, else one step on token ``t - 1``). A stage other
    than the last first reads the wave's token ``t - 1`` from the last stage, and one
    more iteration (``t = n``) reads the final tokens."""
    g = shard.groups
    n = p.max_new_tokens
    last = g.is_last_stage
    links = StageLinks(shard)
    steps = 0
    for t in range(n if last else n + 1):
        stepped = False
        for w in group:
            if w.finished:
                continue
            if not last and t > 0:
                choice, logp = links.recv_choice(w.rows)
                w.record(t - 1, choice, logp, stops, pad_id, n)
                if w.finished:
                    continue
            if g.is_first_stage and t == 0:
                x = w.tokens
            elif g.is_first_stage:
                assert w.choice is not None          # recorded at t - 1
                x = w.choice.unsqueeze(1)
            else:
                x = links.recv_hidden(w.rows, w.longest if t == 0 else 1)
            if t == 0:
                out = w.dec.prefill(x, w.plen)
            else:
                out = w.dec.step(x, pos=w.pos, kv_len=w.longest + t)
                w.pos += 1
                stepped = True
            if not last:
                links.send_hidden(out)
                continue
            choice, logp = _choose(shard, out, p, w, t)
            w.record(t, choice, logp, stops, pad_id, n)
            if g.layout.pp > 1:
                links.send_choice(choice, logp)
        steps += stepped
    links.wait_all()
    return steps


def _choose(shard: ModelShard, logits: torch.Tensor, p: SamplingParams, w: _Wave, t: int):
    """Token ``t`` of each row of a wave and its log-prob, from the last stage's logits."""
    logits = logits.float()[:, : shard.spec.vocab_size]
    choice = choose_tokens(logits, p, w.seq_ids, t, w.noise.at(t))
    logp = logits.log_softmax(-1).gather(1, choice.unsqueeze(1)).squeeze(1)
    return choice, logp
