"""Generation engine of one replica: KV-cache decoding of a batch of variable-length
prompts, at any TP and PP, in the plan's waves (:mod:`realign.runtime.engines.waves`)
or in slots that refill (:mod:`realign.runtime.engines.refill`). With expert
parallelism the data-parallel ranks of an EP group keep in step
(:mod:`realign.runtime.engines.ep_lockstep`), its decode steps eager.

The forward is :class:`~realign.runtime.engines.decoder.StageDecoder` (why not
megatron's inference engines: see there). A wave's prompts are right-padded and
prefilled together in one forward, each row masked to its own length; then every row
advances one token per step at its own position. With pp > 1 the hidden states go
stage to stage and the last stage sends the chosen tokens back.

Returned log-probs are those of the model's own distribution (temperature 1, no
filtering), i.e. what ``InferenceEngine.inference`` recomputes for the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from realign.errors import UserError
from realign.runtime.engines.base import gather_dp
from realign.runtime.engines.captured_step import CaptureSetting, capture_mode
from realign.runtime.engines.ep_lockstep import drain
from realign.runtime.engines.refill import decode_refill
from realign.runtime.engines.waves import decode_waves
from realign.runtime.model import ModelShard
from realign.runtime.sampling import SamplingParams


@dataclass
class Generation:
    """Generated continuations, one row per prompt."""

    tokens: torch.Tensor       #: [b, max_new_tokens] long, ``pad_id`` after the end
    logprobs: torch.Tensor     #: [b, max_new_tokens] float32, 0 after the end
    lengths: torch.Tensor      #: [b] generated tokens (a stop token included)
    kv_cache_peak_bytes: int = 0   #: the most KV-cache bytes this rank held at once
    decode_steps: int = 0          #: decode iterations (waves.DecodeResult.decode_steps)


class GenerateEngine:
    """``generate(prompts, sampling, waves)`` for one replica; every rank of the replica
    calls it with the same prompts and gets the whole result."""

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

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 waves: int = 1, refill: bool = False,
                 capture: CaptureSetting = "auto") -> Generation:
        """Continuations of ``prompts``; each data-parallel rank decodes its share in
        ``waves`` waves (the plan's micro-batches: the KV cache holds only the waves in
        flight), or with ``refill`` in as many slots, each taking the next waiting prompt
        when its sequence ends (:mod:`~realign.runtime.engines.refill`). ``capture``:
        whether the decode steps are captured once per shape and replayed
        (``rollout.capture``; :mod:`~realign.runtime.engines.captured_step`)."""
        self.check(prompts, sampling)
        if waves < 1:
            raise UserError(f"must be >= 1 (got {waves})", field="micro_batches")
        g = self.shard.groups
        per = len(prompts) // g.layout.dp
        first = g.dp_rank * per
        mine = prompts[first:first + per]
        # inference mode: no version counters or autograd metadata on the loop's
        # hundreds of small tensors (~15 % of a small model's generation on CPU; see
        # benchmarks/step/README.md). What
        # leaves it is concatenated below, outside, into an ordinary tensor.
        # expert parallelism reads the exchange's split sizes on the host: eager steps
        if g.ep > 1 and capture == "on":
            raise UserError(
                f"decode steps at expert parallelism (ep {g.ep}) read the token exchange's "
                "split sizes on the host and cannot be captured; set rollout.capture to "
                "auto or off, or plan the generate call at ep 1", field="rollout.capture")
        mode = capture_mode(capture, self.shard.device.kind) if g.ep == 1 else None
        with torch.inference_mode():
            decode = decode_refill if refill else decode_waves
            res = decode(self.shard, mine, sampling, first, waves, self.pad_id, mode)
            # EP > 1: serve the EP group's other ranks until they finish too
            drain(self.shard)
        out = gather_dp(self.shard, torch.cat([res.tokens.double(), res.logprobs.double(),
                                               res.lengths.double().unsqueeze(1)], dim=1))
        n = sampling.max_new_tokens
        return Generation(tokens=out[:, :n].long(), logprobs=out[:, n:2 * n].float(),
                          lengths=out[:, 2 * n].long(),
                          kv_cache_peak_bytes=res.kv_cache_peak_bytes,
                          decode_steps=res.decode_steps)
