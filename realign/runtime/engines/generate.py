"""Generation engine of one replica: KV-cache decoding of a batch of variable-length
prompts, at any TP and PP.

megatron-core's dynamic engine needs flash-attn and its static engine reads the
global parallel state, so the loop is our own, on top of ``GPTModel.forward`` with a
``StaticInferenceContext`` (megatron's KV cache). Prompts are right-padded: the
batch is prefilled up to the shortest prompt, then advances one position per step;
a sequence whose prompt is longer is fed its own prompt token at that position
instead of the sampled one (megatron's static controller does the same). With
pp > 1 the hidden states go stage to stage and the last stage broadcasts the chosen
tokens back over the pipeline group.

Returned log-probs are those of the model's own distribution (temperature 1, no
filtering), i.e. what ``InferenceEngine.inference`` recomputes for the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from realign.errors import UserError
from realign.runtime.engines.base import gather_dp
from realign.runtime.model import ModelShard
from realign.runtime.sampling import SamplingParams, choose_tokens, make_generators


@dataclass
class Generation:
    """Generated continuations, one row per prompt."""

    tokens: torch.Tensor       #: [b, max_new_tokens] long, ``pad_id`` after the end
    logprobs: torch.Tensor     #: [b, max_new_tokens] float32, 0 after the end
    lengths: torch.Tensor      #: [b] generated tokens (a stop token included)


class GenerateEngine:
    """``generate(prompts, sampling)`` for one replica; every rank of the replica calls
    it with the same prompts and gets the whole result."""

    def __init__(self, shard: ModelShard, model=None, pad_id: int = 0):
        self.shard = shard
        self.model = model if model is not None else shard.module
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
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                toks, lps, lens = self._decode(mine, sampling, first)
        finally:
            self.model.train(was_training)
        out = gather_dp(self.shard, torch.cat([toks.double(), lps.double(),
                                               lens.double().unsqueeze(1)], dim=1))
        n = sampling.max_new_tokens
        return Generation(tokens=out[:, :n].long(), logprobs=out[:, n:2 * n].float(),
                          lengths=out[:, 2 * n].long())

    # ---- the loop -------------------------------------------------------------------
    def _decode(self, prompts, p: SamplingParams, first_index: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        dev = self.shard.device.device
        b, n = len(prompts), p.max_new_tokens
        plen = torch.tensor([len(x) for x in prompts], device=dev)
        total = int(plen.max()) + n
        tokens = torch.full((b, total), self.pad_id, dtype=torch.long, device=dev)
        for i, x in enumerate(prompts):
            tokens[i, :len(x)] = torch.tensor(x, device=dev)
        out_tok = torch.full((b, n), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros(b, n, device=dev)
        out_len = torch.zeros(b, dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        stops = torch.tensor(list(p.stop_token_ids) or [-1], device=dev)
        gens = make_generators(p, first_index, b)
        ctx = StaticInferenceContext(b, total)
        cur = int(plen.min())
        inputs = tokens[:, :cur]
        while True:
            logits = self._stage_forward(inputs, ctx)
            ctx.sequence_len_offset += inputs.shape[1]
            gen_pos = cur - plen                          # index of this new token
            new = (gen_pos >= 0) & ~done
            choice, logp = self._choose(logits, p, gens, new)
            rows = new.nonzero().flatten()
            out_tok[rows, gen_pos[rows]] = choice[rows]
            out_lp[rows, gen_pos[rows]] = logp[rows]
            out_len[rows] += 1
            done |= new & (torch.isin(choice, stops) | (gen_pos + 1 >= n))
            if bool(done.all()) or cur >= total:
                break
            nxt = torch.where(cur < plen, tokens[:, cur], choice)
            tokens[:, cur] = nxt
            cur += 1
            inputs = nxt.unsqueeze(1)
            ctx.enable_decode_mode()
        return out_tok, out_lp, out_len

    def _stage_forward(self, inputs: torch.Tensor, ctx):
        """One forward step of this pipeline stage; the last stage returns the
        last-position logits [b, V] (full padded vocabulary), others None."""
        g, spec = self.shard.groups, self.shard.spec
        b, s = inputs.shape
        off = ctx.sequence_len_offset
        pos = torch.arange(off, off + s, device=inputs.device).unsqueeze(0).expand(b, s)
        if not g.is_first_stage:
            hidden = torch.empty(s, b, spec.hidden, dtype=self.shard.device.dtype,
                                 device=inputs.device)
            dist.recv(hidden, src=g.world_rank(g.tp_rank, g.dp_rank, g.pp_rank - 1))
            self.model.set_input_tensor(hidden)
        out = self.model(inputs, pos, None, inference_context=ctx, runtime_gather_output=True)
        if not g.is_last_stage:
            dist.send(out.contiguous(), dst=g.world_rank(g.tp_rank, g.dp_rank, g.pp_rank + 1))
            return None
        return out[:, -1, :]

    def _choose(self, logits, p: SamplingParams, gens, active: torch.Tensor):
        """Next token and its log-prob on the last stage, broadcast to every stage."""
        shard = self.shard
        g = shard.groups
        packed = None
        if g.is_last_stage:
            logits = logits.float()[:, : shard.spec.vocab_size]
            choice = choose_tokens(logits, p, gens, active)
            logp = logits.log_softmax(-1).gather(1, choice.unsqueeze(1)).squeeze(1)
            packed = torch.stack([choice.double(), logp.double()])
        if g.layout.pp > 1:
            if packed is None:
                packed = torch.empty(2, active.shape[0], dtype=torch.float64, device=shard.device.device)
            dist.broadcast(packed, src=g.world_rank(g.tp_rank, g.dp_rank, g.layout.pp - 1),
                           group=g.pgs.pp)
        return packed[0].long(), packed[1].float()
