"""What each kind of MFC does on the ranks of its mesh, with records in and out.

* ``generate``: the actor samples responses to the step's prompts (each prompt
  ``samples_per_prompt`` times; a greedy call once each) -> ``seqs`` + ``logprobs``;
* ``inference``: log-probs (LM head) or values / scores (value head) of sequences;
* ``train``: the algorithm's ``prepare`` (advantages, returns) on the gathered
  records, then one optimizer step per mini-batch and epoch with its loss;
* rule rewards: the reward function on the decoded response and the reference answer.
Engines are created once per replica and reused (the optimizer state lives in the
train engine).
"""
from __future__ import annotations

import torch

from realign.controller.program import Call, RuleReward
from realign.runtime.engines.generate import GenerateEngine
from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.engines.train import TrainEngine
from realign.runtime.settings import SamplingParams, TrainConfig
from realign.worker.records import Record, merge, sequences_from_generation
from realign.worker.replicas import Hosted


#: train metrics that are the same on every rank of the replica (the rest are the
#: loss function's, per DP rank)
GLOBAL_TRAIN_METRICS = ("grad_norm", "update_ok")


class Calls:
    def __init__(self, *, specs, heads, shape, algorithm, algo_cfg, train_cfg: TrainConfig,
                 sampling, tokenizer, pad_id: int, eos_id: int | None, reward_fn, seed: int):
        self.specs, self.heads, self.shape = specs, heads, shape
        self.algorithm, self.algo_cfg, self.train_cfg = algorithm, algo_cfg, train_cfg
        self.sampling, self.tokenizer = sampling, tokenizer
        self.pad_id, self.eos_id, self.reward_fn, self.seed = pad_id, eos_id, reward_fn, seed
        self.train_engines: dict[str, TrainEngine] = {}

    # ---- dispatch ------------------------------------------------------------------
    def call(self, op: Call, h: Hosted, store: dict[str, Record], step: int):
        """``(records, metrics, dp_parts)``: the records the call made, its metrics
        (the op's first rank reports them) and this rank's share of the metrics the
        controller averages over data-parallel ranks (a train call's loss metrics, from
        one rank of each DP rank's last stage; empty elsewhere)."""
        if op.kind == "train":
            return self.train(op, h, store, step)
        fn = {"generate": self.generate, "inference": self.inference}[op.kind]
        return *fn(op, h, store, step), {}

    # ---- generate ------------------------------------------------------------------
    def generate(self, op: Call, h: Hosted, store, step):
        prompts_rec = store["prompts"]
        rows = [prompts_rec["tokens"][i, :int(n)].tolist()
                for i, n in enumerate(prompts_rec["lengths"])]
        greedy = "greedy_seqs" in op.outputs
        k = 1 if greedy else self.shape.samples_per_prompt
        prompts = [r for r in rows for _ in range(k)]
        s = self.sampling
        params = SamplingParams(
            max_new_tokens=self.shape.gen_len, greedy=greedy, temperature=s.temperature,
            top_k=s.top_k, top_p=s.top_p,
            stop_token_ids=(self.eos_id,) if self.eos_id is not None else (),
            seed=self.seed * 1_000_003 + step * len(prompts))
        gen = GenerateEngine(h.shard, pad_id=self.pad_id).generate(prompts, params)
        seqs, logprobs = sequences_from_generation(prompts, gen.tokens, gen.logprobs,
                                                   gen.lengths, self.pad_id)
        out = {op.outputs[0]: seqs}
        if len(op.outputs) > 1:
            out[op.outputs[1]] = logprobs
        prefix = "greedy_" if greedy else ""
        return out, {f"{prefix}gen_tokens": float(gen.lengths.sum()),
                     f"{prefix}response_len": float(gen.lengths.float().mean())}

    # ---- inference -----------------------------------------------------------------
    def inference(self, op: Call, h: Hosted, store, step):
        rec = store[op.inputs[0]]
        batch = {"tokens": rec["tokens"], "lengths": rec["lengths"]}
        res = InferenceEngine(h.shard, micro_batches=op.micro_batches).inference(batch)
        key = op.outputs[0]
        if self.heads[op.role] == "lm":
            return {key: {key: res["logprobs"]}}, {}
        if key in ("rewards", "greedy_rewards"):
            scores = res["scores"].float()
            return {key: {key: scores}}, {f"{key.removesuffix('s')}_mean": float(scores.mean())}
        return {key: {key: res["values"].float()}}, {}

    # ---- rule rewards --------------------------------------------------------------
    def rule_reward(self, op: RuleReward, store, step):
        seqs, prompts = store[op.seqs_key], store["prompts"]
        k = len(seqs["tokens"]) // len(prompts["answers"])
        rows = zip(seqs["tokens"].tolist(), seqs["prompt_lengths"].tolist(),
                   seqs["lengths"].tolist())
        texts = self.tokenizer.batch_decode([t[p:n] for t, p, n in rows],
                                            skip_special_tokens=True)
        r = torch.tensor([float(self.reward_fn(prompts["texts"][i // k], text,
                                               prompts["answers"][i // k]))
                          for i, text in enumerate(texts)], dtype=torch.float32)
        return {op.out_key: {op.out_key: r}}, {f"{op.out_key.removesuffix('s')}_mean": float(r.mean())}

    # ---- train ---------------------------------------------------------------------
    def train(self, op: Call, h: Hosted, store, step):
        records = []
        for key in op.inputs:
            rec = store[key]
            if key == "greedy_seqs":   # ReMax without a reward model: scored already
                continue
            records.append({k: v for k, v in rec.items() if isinstance(v, torch.Tensor)})
        batch = self.algorithm.prepare(merge(records), self.algo_cfg)
        engine = self.train_engine(op, h)
        loss_fn = self.algorithm.loss_fn(op.role, self.algo_cfg)
        rows = batch["tokens"].shape[0]
        n_mb = self.shape.ppo_minibatches
        size = rows // n_mb
        totals: dict[str, float] = {}
        n = 0
        for _epoch in range(self.shape.ppo_epochs):
            for m in range(n_mb):
                sl = slice(m * size, (m + 1) * size)
                sub = {k: (v[sl] if isinstance(v, torch.Tensor) and v.dim() > 0
                           and v.shape[0] == rows else v) for k, v in batch.items()}
                # the loss metrics are averaged over DP by the controller (no
                # collective): each DP rank's last stage reports its own
                res = engine.train_step(sub, loss_fn, dp_mean=False)
                for k, v in res.items():
                    totals[k] = totals.get(k, 0.0) + float(v)
                n += 1
        means = {k: v / n for k, v in totals.items()}
        shared = {k: means.pop(k) for k in GLOBAL_TRAIN_METRICS if k in means}
        g = h.shard.groups
        parts = {}
        if g.is_last_stage and g.tp_rank == 0:
            parts = {f"{op.role}.{k}": v for k, v in means.items()}
            if op.role in ("actor", "reward"):
                parts.update({k: v for k, v in means.items() if k in ("loss", "kl")})
        return {}, {f"{op.role}.{k}": v for k, v in shared.items()}, parts

    def train_engine(self, op: Call, h: Hosted) -> TrainEngine:
        if op.replica not in self.train_engines:
            cfg = self.train_cfg.model_copy(update={"micro_batches": op.micro_batches})
            self.train_engines[op.replica] = TrainEngine(h.shard, cfg)
        return self.train_engines[op.replica]
