"""A worker's session: set-up from the controller's message, then steps, checkpoints
and the final save. Everything a step needs is derived from (config, plan, step), so
a resumed run repeats exactly what an uninterrupted one does: the batch of step k is
the sampler's k-th batch, sampling seeds derive from the step, and the checkpoint
holds the only other state (weights and optimizer state of trained copies)."""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from planner.specs.lora import LoraSpec
from realign.algorithms import registry
from realign.algorithms.params import max_round_prompts, max_sampling_rounds
from realign.config.experiment import LoraConfig
from realign.data.datasets import PromptExample, load_dataset
from realign.data.sampler import PromptSampler
from realign.data.step_batch import prompts_record, step_batch
from realign.data.tokenizer import load_tokenizer, pad_id
from realign.errors import UserError
from realign.run import checkpoint
from realign.run.ops import Call
from realign.run.spec import RunSpec
from realign.runtime.device import init_device
from realign.runtime.hf_checkpoint import read_hf_config, save_hf_checkpoint, spec_from_hf
from realign.runtime.lora import load_trained_state, trained_state
from realign.runtime.lora_peft import save_merged_checkpoint, save_peft_adapter
from realign.runtime.optimizer_state import load_optimizer_state, optimizer_state, torch_optimizers
from realign.worker.calls import Calls
from realign.worker.replicas import build_replicas
from realign.worker.runner import StepReport, StepRunner
from realign.worker.sampling_loop import DropRate, SamplingLoop

#: a rank file's entry of the rollout generated ahead and not yet trained on
IN_FLIGHT = "in_flight"
#: a rank file's entry of a streaming run's generator: its schedule and samples
STREAM = "stream"
#: a rank file's entry of DAPO's drop rate over earlier steps (sizes later rounds)
DROP_RATE = "drop_rate"
#: how far apart the data seeds of DAPO's sampling rounds are
ROUND_DATA_SEED = 7919

_RESHARDED = ("it was written by an optimizer sharded differently (train."
              "distributed_optimizer, or the plan's data-parallel layout)")


def check_optimizer_layout(saved: dict, zero1: bool, name: str) -> None:
    """A checkpoint's optimizer state only fits an optimizer sharded the same way (the
    rank file's record; absent before it was recorded)."""
    checkpoint.check_sharding(saved.get("distributed_optimizer"), zero1, name)


def check_optimizer_shapes(optimizer, name: str) -> None:
    """Loaded Adam moments must have their parameters' shapes (torch does not check);
    catches checkpoints from before the sharding was recorded."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            moment = optimizer.state.get(p, {}).get("exp_avg")
            if moment is not None and moment.shape != p.shape:
                raise UserError(f"checkpoint {name}: optimizer state of shape "
                                f"{tuple(moment.shape)} for a parameter of shape "
                                f"{tuple(p.shape)}; {_RESHARDED}",
                                field="train.distributed_optimizer")


class Session:
    def __init__(self, spec: RunSpec, rank: int, world: int, store,
                 resume_dir: str | None = None):
        self.rank, self.world = rank, world
        cfg = self.cfg = spec.config
        self.spec = spec
        self.paths = {role: str(p) for role, p in spec.paths.items()}
        self.program = spec.program()
        # the device index on this host (launchers set LOCAL_RANK; Ray shows one GPU each)
        self.dev = init_device(cfg.device, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                               dtype=cfg.run_dtype())
        if self.dev.kind == "cuda":
            short = self.program.memory_shortfall(rank, torch.cuda.mem_get_info()[0])
            if short:
                raise UserError(f"{short}; free the GPU or plan for less memory",
                                field="plan")
        timeout = datetime.timedelta(seconds=spec.collective_timeout_s())
        dist.init_process_group(self.dev.backend, store=store, rank=rank, world_size=world,
                                timeout=timeout,
                                device_id=self.dev.device if self.dev.kind == "cuda" else None)
        torch.manual_seed(cfg.run.seed)
        self.tokenizer = load_tokenizer(self.paths[spec.tokenizer_role],
                                        cls=spec.tokenizer_class)
        self.pad = pad_id(self.tokenizer)
        assert cfg.data is not None, "prepare refuses a run without data"
        self.dataset = load_dataset(cfg.data.train, self.tokenizer)
        self.eval_record = None
        if cfg.eval is not None:
            held = load_dataset(cfg.eval.data, self.tokenizer, field="eval.data")
            # prepare checks that eval.data is of kind prompts
            held_prompts = cast(tuple[PromptExample, ...], held.examples)
            self.eval_record = prompts_record(held_prompts[:spec.eval_prompts], self.pad)
        self.algo = registry.get(cfg.algorithm.name)
        from realign.rewards.registry import load_reward_fn
        reward_fn = verifier = None
        if spec.reward_fn is not None:
            reward_fn = load_reward_fn(spec.reward_fn)
        if spec.verifier is not None:
            verifier = load_reward_fn(spec.verifier, field="eval.verifier")
        make_env = None
        if cfg.rollout.multi_turn:       # checked by prepare: loads as it did there
            from realign.agents.loading import env_factory
            make_env = env_factory(cfg.rollout)
        self.specs = {r: spec_from_hf(p) for r, p in self.paths.items()}
        self.loras: dict[str, LoraSpec] = {role: lc.spec() for role, lc in cfg.lora.items()}
        self.hosted = build_replicas(
            self.program, self.specs, self.paths, self.dev, cfg.run.seed,
            use_te=cfg.train.transformer_engine, loras=self.loras,
            adapters={role: lc.init_from
                      for role, lc in cfg.lora.items() if lc.init_from})
        dist.barrier()              # every world rank's groups exist before any traffic
        self.calls = Calls(specs=self.specs, algorithm=self.algo, algo_params=spec.params,
                           train_cfg=cfg.train, sampling=cfg.sampling,
                           tokenizer=self.tokenizer, pad_id=self.pad,
                           eos_id=self.tokenizer.eos_token_id, reward_fn=reward_fn,
                           verifier=verifier, seed=cfg.run.seed,
                           max_staleness=self.program.max_staleness,
                           asynchronous=self.program.asynchronous
                           or cfg.rollout.mode == "streaming",
                           logprob_diff_threshold=cfg.rollout.logprob_diff_threshold,
                           multi_turn=cfg.rollout, make_env=make_env,
                           capture=cfg.rollout.capture,
                           routing_replay=cfg.rollout.routing_replay)
        self._start_vllm(rank)
        self.runner = StepRunner(self.program, self.hosted, self.calls, rank,
                                 self.dev.device, self.dev.dtype, spec.plan.cluster.gpus_per_node,
                                 loras=self.loras)
        # train engines exist before a checkpoint is loaded into them
        for op in self.program.ops:
            if isinstance(op, Call) and op.kind == "train" and rank in op.ranks:
                self.calls.train_engine(op, self.hosted[op.replica])
        #: asynchronous programs: the next step run still has to generate its own
        #: rollout (none was made ahead, or the checkpoint's cannot be used)
        self.needs_prologue = self.program.asynchronous
        #: DAPO's sampling rounds: the drop rate of earlier steps (every rank alike)
        self.drop_rate = DropRate()
        #: rollout.mode streaming: this worker's side of the stream
        self.stream = None
        if cfg.rollout.mode == "streaming":
            from realign.worker.stream_setup import StreamSide
            self.stream = StreamSide(self)
        if resume_dir:
            self.load(Path(resume_dir))

    def _start_vllm(self, rank: int) -> None:
        """A vLLM engine for each replica that generates on vLLM on this rank (the
        plan's ``engine: vllm``) at the call's TP, hosted by the replica's TP rank 0
        (the other TP ranks hold a handle without an engine), started from the role's
        checkpoint folder; its weights are replaced before each call (a LoRA actor's
        adapters only: its base is that checkpoint)."""
        from realign.runtime.engines.vllm_engine import VLLMEngine, tp_devices

        a = self.cfg.algorithm
        for op in self.program.ops:
            if (isinstance(op, Call) and op.engine == "vllm" and rank in op.ranks
                    and op.replica not in self.calls.vllm_engines):
                shard = self.hosted[op.replica].shard
                assert shard is not None, f"rank {rank} is in {op.name}'s ranks"
                g = shard.groups
                local = int(os.environ.get("LOCAL_RANK", rank))
                self.calls.vllm_engines[op.replica] = VLLMEngine(
                    self.paths[op.role], self.cfg.rollout.vllm, self.dev.dtype,
                    a.prompt_len + a.gen_len, device_kind=self.dev.kind,
                    device_index=local, seed=self.cfg.run.seed, tp=g.layout.tp,
                    host=g.tp_rank == 0, devices=tp_devices(g, local),
                    lora=shard.lora,
                    moe_top_k=moe.top_k if (moe := shard.spec.moe)
                    else 0)

    # ---- data of a step --------------------------------------------------------------
    def dataset_record(self, step: int) -> dict:
        """The step's training batch (the sampler's ``step``-th) under the graph's
        training data key, and the held-out prompts under ``eval_prompts`` when the run
        evaluates."""
        # the prompts generated for: more than those trained under DAPO's dynamic sampling
        batch = step_batch(self.dataset, self.cfg.algorithm.shape().prompts_generated, step,
                           self.pad)
        out = {self.algo.spec.dataset_key: batch}
        if self.eval_record is not None:
            out["eval_prompts"] = self.eval_record
        return out

    def round_prompts(self, step: int, sampling_round: int, n: int) -> dict:
        """DAPO's sampling round ``sampling_round`` (1, 2, ...) of step ``step``: ``n``
        prompts, the first ``n`` of the ``step``-th batch of ``max_round_prompts`` of an
        order of the training data of the round's own (shuffled, seeded by the data's
        seed and the round), so they derive from (step, round, n) alone."""
        c = self.dataset.config
        cap = max_round_prompts(self.spec.params)
        assert n <= cap, (n, cap)            # round_size keeps a round within the cap
        sampler = PromptSampler(len(self.dataset), cap,
                                seed=c.seed + ROUND_DATA_SEED * sampling_round, shuffle=True)
        sampler.consumed = step * cap
        # sampling rounds resample prompts: the dataset is of kind prompts
        examples = cast(list[PromptExample], self.dataset.take(sampler.next_batch()[:n]))
        batch = prompts_record(examples, self.pad)
        return {self.algo.spec.dataset_key: batch}

    def sampling_loop(self, step: int) -> SamplingLoop | None:
        """The step's sampling rounds (None: the program samples once a step): later
        rounds sized from the drop rate so far, in multiples of the prompts whose rows
        split over every round call's data-parallel ranks."""
        span = self.program.rounds
        if span is None:
            return None
        dp = {r.key: r.dp for r in self.program.replicas}
        return SamplingLoop(span, max_sampling_rounds(self.spec.params), self.rank, self.pad,
                            lambda r, n: self.round_prompts(step, r, n),
                            history=self.drop_rate,
                            cap_prompts=max_round_prompts(self.spec.params),
                            quantum=self.program.round_quantum(), dps=dp)

    def evaluates_at(self, step: int) -> bool:
        """Whether step ``step`` (0-based) ends with an evaluation: after the first step,
        after every ``eval.interval``-th, and after the last."""
        ev = self.cfg.eval
        return (self.program.evaluates and ev is not None
                and (step == 0 or (step + 1) % ev.interval == 0 or step + 1 == self.spec.steps))

    def step(self, step: int) -> StepReport:
        if self.stream is not None:
            return self.stream.step(step)
        ahead = self.program.asynchronous and step + 1 < self.spec.steps
        report = self.runner.run(step, self.dataset_record(step), self.evaluates_at(step),
                                 next_dataset=self.dataset_record(step + 1) if ahead else None,
                                 prologue=self.needs_prologue,
                                 rounds=self.sampling_loop(step))
        self.needs_prologue = False
        return report

    # ---- checkpoints -----------------------------------------------------------------
    def _trained_here(self):
        for key, h in self.hosted.items():
            if h.replica.trained and h.shard is not None and key in self.calls.train_engines:
                yield key, h

    def save(self, folder: str) -> tuple[str, int, str]:
        """Write this rank's trained state; (file name, size, SHA-256) for the manifest."""
        state = {}
        buf = io.BytesIO()
        # offloaded training state comes back while it is read and written (the state
        # dicts hold the optimizer's tensors, not copies)
        with contextlib.ExitStack() as resident:
            for key, h in self._trained_here():
                eng = self.calls.train_engines[key]
                resident.enter_context(eng.state_on_device())
                # a LoRA model keeps its adapters (and value head) only: the frozen
                # base is the run's models.<role>, referenced, not copied
                state[key] = {"module": trained_state(h.shard),
                              "optimizer": optimizer_state(eng.optimizer),
                              "distributed_optimizer": eng.zero1}
            if self.stream is not None:
                state[STREAM] = self.stream.state()
            if self.program.rounds is not None:
                state[DROP_RATE] = asdict(self.drop_rate)
            if self.runner.carried:     # the samples in flight: generated, not yet trained
                state[IN_FLIGHT] = {"records": self.runner.carried,
                                    "metrics": self.runner.carried_metrics}
            torch.save(state, buf)
        data, name = buf.getvalue(), f"rank{self.rank}.pt"
        checkpoint.save_file(data, Path(folder) / name)
        return (name, *checkpoint.bytes_digest(data))

    def load(self, folder: Path) -> None:
        state = torch.load(folder / f"rank{self.rank}.pt", map_location=self.dev.device,
                           weights_only=False)
        if self.program.asynchronous and checkpoint.in_flight_usable(
                checkpoint.read_manifest(folder), self.program.ahead_ranks):
            self.needs_prologue = False
            flight = state.get(IN_FLIGHT, {"records": {}, "metrics": {}})
            self.runner.carried = flight["records"]
            self.runner.carried_metrics = flight["metrics"]
        if self.stream is not None:
            self.stream.load(state.get(STREAM))
        if self.program.rounds is not None:
            self.drop_rate = DropRate(**state.get(DROP_RATE, {}))
        for key, h in self._trained_here():
            eng = self.calls.train_engines[key]
            check_optimizer_layout(state[key], eng.zero1, folder.name)
            load_trained_state(h.shard, state[key]["module"], f"checkpoint {folder.name}")
            with eng.state_on_device():
                try:
                    load_optimizer_state(eng.optimizer, state[key]["optimizer"])
                except ValueError as e:     # torch: parameter groups of other sizes
                    raise UserError(f"checkpoint {folder.name}: {e}; {_RESHARDED}",
                                    field="train.distributed_optimizer") from None
                for opt in torch_optimizers(eng.optimizer):
                    check_optimizer_shapes(opt, folder.name)

    def save_final(self, folder: str) -> None:
        """The trained actor (or reward model under ``rm``) as a HF checkpoint."""
        role = self.spec.final_role
        loras: dict[str, LoraConfig] = dict(self.cfg.lora.items())
        for _key, h in self.hosted.items():
            if h.replica.role == role and h.replica.trained:
                if h.shard is not None and h.shard.lora is not None:
                    # the adapters in PEFT's format; the merged model on request
                    save_peft_adapter(h.shard, folder, self.paths[role])
                    if loras[role].merged:
                        save_merged_checkpoint(h.shard, Path(folder) / "merged",
                                               read_hf_config(self.paths[role]))
                elif h.shard is not None:
                    save_hf_checkpoint(h.shard, folder, read_hf_config(self.paths[role]))
                break
        dist.barrier()
        if self.rank == 0:
            Path(folder).mkdir(parents=True, exist_ok=True)
            for f in Path(self.paths[role]).iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges",
                                      "chat_template")):
                    shutil.copy(f, Path(folder) / f.name)
                    lora = loras.get(role)
                    if lora is not None and lora.merged:
                        shutil.copy(f, Path(folder) / "merged" / f.name)

    def close(self) -> None:
        for engine in self.calls.vllm_engines.values():
            engine.close()
        dist.destroy_process_group()
