"""What each kind of MFC does on the ranks of its mesh, with records in and out. The
graph's call (:class:`~planner.graph.dataflow.MFC`, carried by the program's ``Call``) says
what: its keys, batch shape and options; the allocation says how (micro-batches).

* ``generate``: the actor samples ``n_seqs / prompts`` responses to each of the
  step's prompts (greedily when the call is greedy), in the plan's waves -> its two
  output records (sequences, then log-probs when it writes them);
* ``inference``: log-probs (LM head), per-token values (critic) or sequence scores
  (reward model) of sequences;
* ``train``: the algorithm's ``prepare`` (advantages, returns; the rows it trains on
  when it selects some of those generated) on exactly the call's input records, then
  one optimizer step per mini-batch and epoch with its loss; the statistics
  ``prepare`` reports become ``<role>.<name>`` metrics;
* rule rewards: the reward function on the decoded response and the reference answer;
* evaluations: the verifier and the reward function on answers to held-out prompts,
  as metrics ``eval.<greedy|sample>_{accuracy,reward}`` and ``eval.pass@k``.
Engines are created once per replica and reused (the optimizer state lives in the
train engine).
"""
from __future__ import annotations

import contextlib
import time

import torch

from realign.algorithms.common import minibatch, pop_stats
from realign.algorithms.mismatch import rollout_mismatch
from realign.data.packing import call_padding
from realign.errors import NonFiniteError, UserError
from realign.rewards.scoring import decoded_answers, scores
from realign.run.ops import Call, Evaluate, RuleReward
from realign.runtime.engines.captured_step import CaptureSetting
from realign.runtime.engines.generate import GenerateEngine
from realign.runtime.engines.inference import InferenceEngine
from realign.runtime.engines.train import TrainEngine
from realign.runtime.lora import adapters_disabled, seed_dropout
from realign.runtime.router_replay import ROUTED_EXPERTS, replayed_share
from realign.runtime.settings import Sampling, SamplingParams, TrainConfig
from realign.worker.episodes import generate_episodes, response_lengths, stop_ids
from realign.worker.records import Record, merge, sequences_from_generation
from realign.worker.replicas import Hosted

#: train metrics that are the same on every rank of the replica (the rest are the
#: loss function's, per DP rank)
GLOBAL_TRAIN_METRICS = ("grad_norm", "update_ok")
#: how far apart the generation seeds of a step's sampling rounds are (beyond any
#: step's: steps are ``len(prompts)`` apart)
ROUND_SEED_STRIDE = 1_000_000_007


class Calls:
    def __init__(self, *, specs, algorithm, algo_params, train_cfg: TrainConfig,
                 sampling: Sampling, tokenizer, pad_id: int, eos_id: int | None, reward_fn,
                 verifier, seed: int, max_staleness: int = 0, asynchronous: bool = False,
                 logprob_diff_threshold: float = 0.01, multi_turn=None, make_env=None,
                 capture: CaptureSetting = "auto", routing_replay: str = "auto"):
        """``reward_fn``: the rule reward (None with a reward model); ``verifier``: what
        counts as correct in evaluations (None without an eval section);
        ``max_staleness``: the most policy versions a trained sample may lag;
        ``asynchronous``: the program runs generation ahead of training;
        ``logprob_diff_threshold``: of the rollout's log-prob mismatch metrics;
        ``routing_replay``: rollout.routing_replay (off: vLLM's routing is not carried)."""
        self.max_staleness = max_staleness
        #: rollout.env / rollout.tools (None: one response per prompt) and what makes
        #: one episode's environment
        self.multi_turn = multi_turn if multi_turn is not None and multi_turn.multi_turn \
            else None
        self.make_env = make_env
        self.asynchronous = asynchronous
        self.logprob_diff_threshold = logprob_diff_threshold
        #: rollout.capture: the own engine's decode steps captured and replayed
        self.capture = capture
        self.routing_replay = routing_replay
        #: replica key -> its vLLM engine on this rank (generate calls with engine vllm)
        self.vllm_engines: dict = {}
        self.specs = specs
        self.algorithm, self.algo_params, self.train_cfg = algorithm, algo_params, train_cfg
        self.sampling, self.tokenizer = sampling, tokenizer
        self.pad_id, self.eos_id, self.reward_fn, self.seed = pad_id, eos_id, reward_fn, seed
        self.verifier = verifier
        self.train_engines: dict[str, TrainEngine] = {}

    # ---- dispatch ------------------------------------------------------------------
    def call(self, op: Call, h: Hosted, store: dict[str, Record], step: int,
             sampling_round: int = 0):
        """``(records, metrics, dp_parts)``: the records the call made, its metrics
        (the op's first rank reports them) and this rank's share of the metrics the
        controller averages over data-parallel ranks (a train call's loss metrics, from
        one rank of each DP rank's last stage; empty elsewhere). ``sampling_round``:
        DAPO's sampling round of the step (generation seeds derive from it)."""
        if op.kind == "train":
            return self.train(op, h, store, step)
        if op.kind == "generate":
            return *self.generate(op, h, store, step, sampling_round), {}
        return *self.inference(op, h, store, step), {}

    # ---- generate ------------------------------------------------------------------
    def generate(self, op: Call, h: Hosted, store, step, sampling_round: int = 0):
        shard = h.shard
        assert shard is not None, f"{op.name} runs on its replica's ranks"
        prompts_rec = store[op.inputs[0]]
        rows = [prompts_rec["tokens"][i, :int(n)].tolist()
                for i, n in enumerate(prompts_rec["lengths"])]
        k = op.mfc.n_seqs // len(rows)          # responses per prompt
        prompts = [r for r in rows for _ in range(k)]
        params = SamplingParams(
            **self.sampling.model_dump(), max_new_tokens=op.mfc.gen_len, greedy=op.mfc.greedy,
            stop_token_ids=(self.eos_id,) if self.eos_id is not None else (),
            # sampling seeds follow the batch (an ahead call makes the next step's) and
            # DAPO's sampling round
            seed=self.seed * 1_000_003 + (step + op.ahead) * len(prompts)
            + sampling_round * ROUND_SEED_STRIDE)
        metrics: dict = {}
        kv_peaks = [0]        # the most KV-cache bytes of the call's generations (turns)
        steps = [0]           # their decode iterations (realign's own engine)

        def peak(gen):
            kv_peaks[0] = max(kv_peaks[0], gen.kv_cache_peak_bytes)
            steps[0] += gen.decode_steps
            return gen
        if op.engine == "vllm":
            # the replica's weights (trained, or just reallocated) into vLLM's storage
            vllm = self.vllm_engines[op.replica]
            t0 = time.perf_counter()
            loaded = vllm.load(shard)
            metrics[f"time.vllm_load.{op.name}"] = time.perf_counter() - t0
            metrics[f"vllm_load_bytes.{op.name}"] = float(loaded)

            def engine(rows, p):
                return peak(vllm.generate(shard, rows, p, self.pad_id))
        else:
            own = GenerateEngine(shard, pad_id=self.pad_id)

            def engine(rows, p):
                return peak(own.generate(rows, p, waves=op.micro_batches,
                                         refill=op.mfc.refill, capture=self.capture))
        prefix = "greedy_" if op.mfc.greedy else ""
        if op.mfc.is_eval:                       # an evaluation's generation
            prefix = f"eval.{'greedy' if op.mfc.greedy else 'sample'}_"
        if self.multi_turn is not None:          # episodes with an environment
            seqs, logprobs, turn_metrics = generate_episodes(
                self.multi_turn, self.make_env, self.tokenizer, prompts, prompts_rec, engine,
                params.model_copy(update={"stop_token_ids": stop_ids(self.tokenizer,
                                                                     self.eos_id)}),
                shard.groups.layout.dp, op.mfc.gen_len, shard.spec.max_seq_len,
                self.pad_id, prefix + "rollout.")
            metrics.update(turn_metrics)
            gen_lengths = response_lengths(seqs)
        else:
            gen = engine(prompts, params)
            seqs, logprobs = sequences_from_generation(prompts, gen.tokens, gen.logprobs,
                                                       gen.lengths, self.pad_id)
            gen_lengths = gen.lengths
            if (op.engine == "vllm" and shard.spec.moe is not None
                    and self.vllm_engines[op.replica].records_routing):
                # tokens whose experts differ between vLLM and the training forward
                # (recorded only where vLLM runs eagerly: nothing logged on CUDA)
                from realign.runtime.engines.vllm_moe import rollout_routing_mismatch

                share, compared = rollout_routing_mismatch(
                    shard, self.vllm_engines[op.replica].routing, prompts, gen,
                    self.pad_id)
                metrics[f"{prefix}moe.routing_mismatch"] = share
                metrics[f"{prefix}moe.routing_tokens"] = float(compared)
                if self.routing_replay != "off" and not prefix:
                    # the rollout's experts travel with its sequences (routing replay)
                    from realign.runtime.engines.vllm_moe import gathered_routing

                    seqs[ROUTED_EXPERTS] = gathered_routing(
                        shard, self.vllm_engines[op.replica].routing, prompts, gen,
                        max(len(q) + int(n) for q, n in zip(prompts, gen.lengths)))
        # the policy version that sampled them: a step reallocates the weights after
        # ``step`` updates; an ahead call on the trained copy itself runs after the
        # step's update
        seqs["policy_version"] = torch.full((len(prompts),), step + op.sees_update,
                                            dtype=torch.long)
        out = {op.outputs[0]: seqs}
        if len(op.outputs) > 1:
            out[op.outputs[1]] = logprobs
        metrics.update({f"{prefix}gen_tokens": float(gen_lengths.sum()),
                        f"{prefix}response_len": float(gen_lengths.float().mean()),
                        f"kv_cache_bytes.{op.name}": float(kv_peaks[0])})
        if op.engine != "vllm":
            metrics[f"decode_steps.{op.name}"] = float(steps[0])
        if not prefix:      # the sampled rollout's lengths, for plan.lengths_from
            metrics["response_len_hist"] = length_histogram(gen_lengths)
        return out, metrics

    # ---- inference -----------------------------------------------------------------
    def inference(self, op: Call, h: Hosted, store, step):
        shard = h.shard
        assert shard is not None, f"{op.name} runs on its replica's ranks"
        rec = store[op.inputs[0]]
        batch = {"tokens": rec["tokens"], "lengths": rec["lengths"]}
        if ROUTED_EXPERTS in rec and op.role == "actor" and not op.mfc.adapters_off:
            # the actor scoring its rollout (prox log-probs): vLLM's experts replayed; the
            # reference (other weights, or the base without adapters) routes on its own
            batch[ROUTED_EXPERTS] = rec[ROUTED_EXPERTS]
        # a frozen role scored as a LoRA model's base: that model with its adapters off
        with adapters_disabled(shard) if op.mfc.adapters_off else contextlib.nullcontext():
            res = InferenceEngine(shard, micro_batches=op.micro_batches,
                                  packing=self.train_cfg.packing,
                                  token_budget=op.token_budget).inference(batch)
        key = op.outputs[0]
        pad = {f"padded_tokens.{op.name}": float(call_padding(
            batch["lengths"], batch["tokens"].shape[1], shard.groups.layout.dp,
            op.micro_batches, "inference", self.train_cfg.packing, op.token_budget))}
        if h.replica.head == "lm":
            return {key: {key: res["logprobs"]}}, pad
        # a reward model (or the critic's base standing for it) scores whole sequences
        if op.name.split(".", 1)[0] == "reward":
            scores = res["scores"].float()
            bad = ~torch.isfinite(scores)
            if bool(bad.any()):
                raise NonFiniteError(
                    f"step {step}: the reward model scored {int(bad.sum())} of "
                    f"{len(scores)} responses {float(scores[bad][0])}; the run stops before "
                    "it trains on them", field="models.reward")
            return {key: {key: scores}}, {f"{key.removesuffix('s')}_mean": float(scores.mean()),
                                          **pad}
        return {key: {key: res["values"].float()}}, pad

    # ---- rule rewards and evaluations ------------------------------------------------
    def rule_reward(self, op: RuleReward, store, step):
        answers = decoded_answers(self.tokenizer, store[op.seqs_key], store[op.prompts_key])
        r = scores(self.reward_fn, answers, step, "sample")
        if "env_reward" in store[op.seqs_key]:    # an environment's per-turn rewards
            r = r + store[op.seqs_key]["env_reward"]
        return {op.out_key: {op.out_key: r}}, {f"{op.out_key.removesuffix('s')}_mean": float(r.mean())}

    def evaluate(self, op: Evaluate, store, step) -> dict[str, float]:
        """``eval.<name>_accuracy`` (the verifier's share of correct answers),
        ``eval.<name>_reward`` (the run's reward function, or the verifier without one)
        and, with several samples per prompt, ``eval.pass@k`` (the share of prompts
        with at least one correct sample of k)."""
        seqs, prompts = store[op.seqs_key], store[op.prompts_key]
        answers = decoded_answers(self.tokenizer, seqs, prompts)
        correct = scores(self.verifier, answers, step, "evaluated answer") >= 0.5
        reward = (scores(self.reward_fn, answers, step, "evaluated answer")
                  if self.reward_fn is not None else correct.float())
        out = {f"eval.{op.name}_accuracy": float(correct.float().mean()),
               f"eval.{op.name}_reward": float(reward.mean())}
        k = len(answers) // len(prompts["answers"])
        if k > 1:
            out[f"eval.pass@{k}"] = float(correct.view(-1, k).any(dim=1).float().mean())
        return out

    # ---- train ---------------------------------------------------------------------
    def train(self, op: Call, h: Hosted, store, step):
        shard = h.shard
        assert shard is not None, f"{op.name} runs on its replica's ranks"
        records: list[dict[str, torch.Tensor]] = [
            {k: v for k, v in store[key].items() if isinstance(v, torch.Tensor)}
            for key in op.inputs]
        merged = merge(records)
        if op.role != "actor":      # the actor's rollout routing: its own calls alone
            merged.pop(ROUTED_EXPERTS, None)
        staleness = check_staleness(merged, step, self.max_staleness, op.name)
        mismatch = rollout_mismatch(merged, self.logprob_diff_threshold)
        if "prox_logprobs" in merged and not (self.asynchronous or self.corrects()):
            # scored to measure the mismatch only: the loss takes the rollout's log-probs
            del merged["prox_logprobs"]
        # prepare may select rows (best-of-N, pairs, dynamic sampling): the call trains
        # the rows it returns, as many as the graph's train call prices
        batch, stats = pop_stats(self.algorithm.prepare(merged, self.algo_params))
        rows = batch["tokens"].shape[0]
        assert rows == op.mfc.n_seqs, f"{op.name}: prepare made {rows} rows, the plan " \
            f"trains {op.mfc.n_seqs}"
        engine = self.train_engine(op, h)
        seed_dropout(shard, self.seed, step, op.role)     # LoRA dropout's masks
        loss_fn = self.algorithm.loss_fn(op.role, self.algo_params)
        n_mb = op.mfc.n_minibatches
        totals: dict[str, float] = {}
        n = 0
        padded = 0
        with engine.call():     # offloaded training state: here for the call's steps
            for _epoch in range(op.mfc.n_epochs):
                for m in range(n_mb):
                    sub = minibatch(batch, m, n_mb)
                    padded += call_padding(sub["lengths"], sub["tokens"].shape[1],
                                           shard.groups.layout.dp, op.micro_batches,
                                           "train", engine.packing, op.token_budget,
                                           op.mfc.group_size)
                    # the loss metrics are averaged over DP by the controller (no
                    # collective): each DP rank's last stage reports its own
                    try:
                        res = engine.train_step(sub, loss_fn, dp_mean=False)
                    except NonFiniteError as e:
                        raise NonFiniteError(f"step {step}, {op.name} (mini-batch {m}): "
                                             f"{e.message}; nothing was saved",
                                             field=e.field) from None
                    for k, v in res.items():
                        totals[k] = totals.get(k, 0.0) + float(v)
                    n += 1
        means = {k: v / n for k, v in totals.items()}
        shared = {k: means.pop(k) for k in GLOBAL_TRAIN_METRICS if k in means}
        if "advantages" in batch:      # rows with no learning signal (a constant reward)
            flat = (batch["advantages"].abs().sum(dim=-1) == 0) if batch["advantages"].dim() > 1 \
                else batch["advantages"] == 0
            shared["zero_advantage_frac"] = float(flat.float().mean())
        if staleness is not None:
            shared["staleness"] = staleness
        shared.update(mismatch)
        shared.update(stats)
        shared["padded_tokens"] = float(padded)
        if ROUTED_EXPERTS in batch:
            # the share of trained tokens whose experts vLLM's rollout forced
            shared["moe.replayed_frac"] = replayed_share(batch[ROUTED_EXPERTS],
                                                         batch["lengths"])
        g = shard.groups
        parts = {}
        if g.is_last_stage and g.tp_rank == 0:
            parts = {f"{op.role}.{k}": v for k, v in means.items()}
            if op.role in ("actor", "reward"):
                parts.update({k: v for k, v in means.items() if k in ("loss", "kl")})
        # its output record: what later calls that read the trained model wait for
        out = {op.outputs[0]: {"step": torch.tensor([step])}}
        return out, {f"{op.role}.{k}": v for k, v in shared.items()}, parts

    def corrects(self) -> bool:
        """Truncated importance sampling is on (``algorithm.params.tis_cap``)."""
        return getattr(self.algo_params, "tis_cap", None) is not None

    def train_engine(self, op: Call, h: Hosted) -> TrainEngine:
        if op.replica not in self.train_engines:
            shard = h.shard
            assert shard is not None, f"{op.name} runs on its replica's ranks"
            self.train_engines[op.replica] = TrainEngine(
                shard, self.train_cfg, micro_batches=op.micro_batches,
                optimizer_offload=op.optimizer_offload, recompute=op.activation_recompute,
                state_offload=op.train_state_offload, token_budget=op.token_budget,
                group_size=op.mfc.group_size)
        return self.train_engines[op.replica]


def check_staleness(batch, step: int, bound: int, call: str) -> float | None:
    """The mean staleness (policy versions between the samples' policy and the one
    trained at ``step``) of a batch that records its samples' versions; a sample more
    than ``bound`` versions stale, or from a future version, stops the run before it
    is trained on (None: the batch has no sampled sequences)."""
    v = batch.get("policy_version")
    if not isinstance(v, torch.Tensor):
        return None
    lag = step - v
    if int(lag.max()) > bound or int(lag.min()) < 0:
        raise UserError(f"step {step}, {call}: a sample of policy version {int(v.min())} "
                        f"is {int(lag.max())} versions stale (allowed: 0 .. {bound}); it is "
                        "not trained on", field="algorithm.max_staleness")
    return float(lag.float().mean())


def length_histogram(lengths: torch.Tensor) -> list[list[int]]:
    """``[[length, count], ...]`` by length: a step's response lengths as metrics.jsonl
    keeps them (one row per step; a histogram stays short when many responses share a
    length, e.g. all that ran to the cap)."""
    values, counts = torch.unique(lengths.long(), return_counts=True)
    return [[int(v), int(c)] for v, c in zip(values.tolist(), counts.tolist())]
