"""Generation engine of one replica: KV-cache decoding of a batch of variable-length
prompts, at any TP and PP.

The forward is :class:`~realign.runtime.engines.decoder.StageDecoder` (why not
megatron's inference engines: see there). Prompts are right-padded and prefilled
together in one forward, each row masked to its own length; then every row advances
one token per step at its own position. With pp > 1 the hidden states go stage to
stage and the last stage broadcasts the chosen tokens back over the pipeline group.

Returned log-probs are those of the model's own distribution (temperature 1, no
filtering), i.e. what ``InferenceEngine.inference`` recomputes for the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from realign.data.collate import pad_right
from realign.errors import UserError
from realign.runtime.engines.base import gather_dp
from realign.runtime.engines.decoder import StageDecoder, run_stage
from realign.runtime.model import ModelShard
from realign.runtime.sampling import SamplingParams, choose_tokens, gumbel_noise

#: float64 noise values drawn per computation (positions x rows x vocabulary): 32 MB
NOISE_BLOCK = 1 << 22


@dataclass
class Generation:
    """Generated continuations, one row per prompt."""

    tokens: torch.Tensor       #: [b, max_new_tokens] long, ``pad_id`` after the end
    logprobs: torch.Tensor     #: [b, max_new_tokens] float32, 0 after the end
    lengths: torch.Tensor      #: [b] generated tokens (a stop token included)


class GenerateEngine:
    """``generate(prompts, sampling)`` for one replica; every rank of the replica calls
    it with the same prompts and gets the whole result."""

    def __init__(self, shard: ModelShard, pad_id: int = 0):
        self.shard = shard
        self.pad_id = pad_id

    def check(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        spec, dp = self.shard.spec, self.shard.groups.layout.dp
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UserError("every prompt needs at least one token", field="prompts")
        if len(prompts) % dp:
            raise UserError(f"{len(prompts)} prompts do not split over dp={dp}",
                            field="prompts")
        longest = max(len(p) for p in prompts) + sampling.max_new_tokens
        if longest > spec.max_seq_len:
            raise UserError(f"prompt + max_new_tokens = {longest} exceeds the model's "
                            f"max_seq_len {spec.max_seq_len}", field="sampling.max_new_tokens")
        if any(t < 0 or t >= spec.vocab_size for p in prompts for t in p):
            raise UserError(f"token ids must be in 0..{spec.vocab_size - 1}", field="prompts")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Generation:
        self.check(prompts, sampling)
        g = self.shard.groups
        per = len(prompts) // g.layout.dp
        first = g.dp_rank * per
        mine = prompts[first:first + per]
        # inference mode: no version counters or autograd metadata on the loop's
        # hundreds of small tensors (~15 % of a small model's generation on CPU). What
        # leaves it is concatenated below, outside, into an ordinary tensor.
        with torch.inference_mode():
            toks, lps, lens = self._decode(mine, sampling, first)
        out = gather_dp(self.shard, torch.cat([toks.double(), lps.double(),
                                               lens.double().unsqueeze(1)], dim=1))
        n = sampling.max_new_tokens
        return Generation(tokens=out[:, :n].long(), logprobs=out[:, n:2 * n].float(),
                          lengths=out[:, 2 * n].long())

    # ---- the loop -------------------------------------------------------------------
    def _decode(self, prompts, p: SamplingParams, first_index: int):
        dev = self.shard.device.device
        b, n = len(prompts), p.max_new_tokens
        tokens, plen = pad_right(prompts, self.pad_id)
        tokens, plen, longest = tokens.to(dev), plen.to(dev), tokens.shape[1]
        out_tok = torch.full((b, n), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros(b, n, device=dev)
        out_len = torch.zeros(b, dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        stops = torch.tensor(list(p.stop_token_ids) or [-1], device=dev)
        seq_ids = torch.arange(first_index, first_index + b, device=dev)
        # the RoPE tables made here are cached (on the shard, in megatron) for
        # training forwards too: keep them ordinary tensors
        with torch.inference_mode(False):
            dec = StageDecoder(self.shard, longest + n, cache_rows=b)
        logits = run_stage(self.shard, partial(dec.prefill, lengths=plen), tokens)
        pos = plen.clone()                                   # where the next token goes
        noise = _NoiseBlocks(p, seq_ids, n, self.shard.spec.vocab_size)
        for t in range(n):
            choice, logp = self._choose(logits, p, seq_ids, t, noise)
            live = ~done
            out_tok[:, t] = torch.where(live, choice, self.pad_id)
            out_lp[:, t] = torch.where(live, logp, 0.0)
            out_len += live.long()
            done |= torch.isin(choice, stops)
            if t + 1 == n or bool(done.all()):
                break
            logits = run_stage(self.shard, partial(dec.step, pos=pos, kv_len=longest + t + 1),
                               choice.unsqueeze(1))
            pos += 1
        return out_tok, out_lp, out_len

    def _choose(self, logits, p: SamplingParams, seq_ids: torch.Tensor, t: int,
                noise: _NoiseBlocks):
        """Next token and its log-prob on the last stage, broadcast to every stage."""
        shard = self.shard
        g = shard.groups
        packed = None
        if g.is_last_stage:
            logits = logits.float()[:, : shard.spec.vocab_size]
            choice = choose_tokens(logits, p, seq_ids, t, noise.at(t))
            logp = logits.log_softmax(-1).gather(1, choice.unsqueeze(1)).squeeze(1)
            if g.layout.pp == 1:
                return choice, logp
            packed = torch.stack([choice.double(), logp.double()])
        if packed is None:
            packed = torch.empty(2, seq_ids.shape[0], dtype=torch.float64,
                                 device=shard.device.device)
        dist.broadcast(packed, src=g.world_rank(g.tp_rank, g.dp_rank, g.layout.pp - 1),
                       group=g.pgs.pp)
        return packed[0].long(), packed[1].float()


class _NoiseBlocks:
    """The sampling noise of the generated positions, made a block of positions at a
    time (at most :data:`NOISE_BLOCK` values) rather than once per position."""

    def __init__(self, p: SamplingParams, seq_ids: torch.Tensor, n: int, vocab: int):
        self.p, self.seq_ids, self.n, self.vocab = p, seq_ids, n, vocab
        self.per_block = max(1, NOISE_BLOCK // max(1, seq_ids.shape[0] * vocab))
        self.start, self.block = 0, None

    def at(self, t: int) -> torch.Tensor | None:
        """Noise [b, vocab] of position ``t`` (None when greedy)."""
        if self.p.greedy:
            return None
        if self.block is None or not self.start <= t < self.start + self.block.shape[0]:
            self.start = t
            end = min(self.n, t + self.per_block)
            self.block = gumbel_noise(self.p.seed, self.seq_ids, range(t, end), self.vocab)
        return self.block[t - self.start]
