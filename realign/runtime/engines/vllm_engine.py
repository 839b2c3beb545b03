"""Generation on vLLM: one engine per worker of a generate call that the plan runs on
vLLM (``engine: vllm``), fed the replica's own weights before each call.

The engine is vLLM's ``LLM`` in its multi-process mode: its engine core is a child
process of the realign worker (started with ``spawn``), so vLLM's own
``torch.distributed`` world stays apart from the worker's (a single-process engine
would build its groups over the worker's world, a collective the other workers never
join). The worker is the engine's only client; nothing else manages it.

* **Layout**: the engine runs at the generate call's TP (the plan's layout, PP 1): the
  replica's TP rank 0 of each data-parallel rank hosts one ``LLM`` with
  ``tensor_parallel_size`` = TP, whose engine core starts one vLLM worker process per
  TP rank on the replica's own devices (CUDA: the GPUs of the replica's TP group; CPU:
  one core set per worker). vLLM's TP group is its own, among its workers: vLLM's
  ``external_launcher`` executor would instead build its groups with world-wide
  ``new_group`` calls and barriers over the caller's ``torch.distributed`` world,
  which in realign holds every worker of the run, including those off the generate
  call's mesh and those busy with other calls. The other TP ranks of the replica
  host no engine: they take part in the weight gathers and receive the outputs.
* **Weights** (:meth:`VLLMEngine.load`): the replica's parameters (after the plan's
  reallocation into the call's layout) go to vLLM in memory, in buckets of whole
  layers, through a :class:`~realign.runtime.engines.vllm_weights.WeightTransport`:
  POSIX shared memory on CPU, CUDA IPC (or NCCL where vLLM's workers are on other
  GPUs) on CUDA (:mod:`realign.runtime.engines.vllm_cuda_weights`); then the prefix
  cache is reset. :meth:`VLLMEngine.load_files` keeps the safetensors-folder route for
  comparison (``benchmarks/generate``).
* **LoRA** (``lora``, the actor's adapters): vLLM's own LoRA; the frozen base is the
  checkpoint the engine starts from, never sent again, and each load hands vLLM only
  the adapters, in memory, under a new id that the call's requests name
  (:mod:`realign.runtime.engines.vllm_lora`).
* **Sampling** (:meth:`VLLMEngine.generate`): realign's settings map one to one
  (temperature, top-k, top-p; greedy is temperature 0); the stop tokens are realign's
  (the tokenizer's end token; vLLM's own end-of-sequence rule is off, so both engines
  stop alike) and are kept in the output; each sequence's seed is the call's seed plus
  its index in the call. The log-probs are vLLM's raw ones (``logprobs_mode``
  ``raw_logprobs``): the model's own distribution at temperature 1, what realign's
  engine returns and the training forward computes.
* **Routing** (``moe_top_k`` > 0, a mixture of experts, on an engine that runs
  eagerly: CPU): the experts vLLM's routers chose for every token of each sequence,
  kept in ``routing.last`` after each call
  (:mod:`realign.runtime.engines.vllm_routing`), for rollout routing replay; on CUDA
  (CUDA graphs) none is recorded (``records_routing`` False on every rank).
* **Records**: tokens padded with ``pad_id`` after the end, log-probs 0 there, lengths
  with the stop token: :class:`~realign.runtime.engines.generate.Generation`, as
  realign's engine returns, gathered over the data-parallel ranks.

CUDA: the same code (``enforce_eager`` off, so decode runs as CUDA graphs; the KV cache
is ``kv_cache_memory_bytes`` on each of the replica's GPUs, which the children are
shown alone; vLLM
refuses to start unless ``gpu_memory_utilization`` of the GPU is free, so that share is
set to what it needs: :func:`cuda_memory_share`). It has not run on a GPU
(docs/vllm.md).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from realign.runtime.engines.base import gather_dp
from realign.runtime.engines.generate import Generation
from realign.runtime.engines.vllm_lora import VLLMAdapters, lora_engine_args
from realign.runtime.engines.vllm_routing import VLLMRouting, records_routing, vllm_eager
from realign.runtime.engines.vllm_weights import (
    BUCKET_BYTES,
    SharedMemoryTransport,
    WeightTransport,
    bucket_capacity,
    group_bytes,
    push_hf,
    push_weights,
    weight_groups,
)
from realign.runtime.lora_peft import peft_config
from realign.runtime.model import ModelShard
from realign.runtime.settings import SamplingParams, VLLMSettings

GIB = 2 ** 30
#: how long closing waits for vLLM's child processes to end
CLOSE_TIMEOUT_S = 10.0
#: where the weights go between realign and vLLM (a tmpfs where there is one)
SHARED_MEMORY = Path("/dev/shm")
#: realign's methods on vLLM's workers (the shared-memory weight update)
WORKER_EXTENSION = "realign.runtime.engines.vllm_worker_ext.RealignWorkerExtension"


def child_visible_devices(visible: str | None, index: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the engine's child: only the worker's own GPU, the
    ``index``-th of those the worker sees.

    Example: ``"4,5,6,7"``, 1 -> ``"5"``; unset, 3 -> ``"3"``."""
    if visible:
        return visible.split(",")[index].strip()
    return str(index)


def tp_devices(groups, local_index: int) -> list[int]:
    """The local device index of each TP rank of this rank's replica, in TP order: where
    the engine's workers run. A collective over the replica's TP group at TP > 1.

    Example: TP 2 on the node's GPUs 4 and 5 -> ``[4, 5]`` on both ranks."""
    if groups.layout.tp == 1:
        return [local_index]
    import torch.distributed as dist

    out: list = [None] * groups.layout.tp
    dist.all_gather_object(out, local_index, group=groups.pgs.tp)
    return [int(i) for i in out]


#: CUDA: memory vLLM needs besides its weights and KV cache (activations, CUDA graphs)
CUDA_HEADROOM_BYTES = 2 * GIB


def cuda_memory_share(weights_bytes: float, kv_bytes: float, total_bytes: float) -> float:
    """vLLM's ``gpu_memory_utilization`` on a GPU realign's models share: the weights,
    the KV cache and :data:`CUDA_HEADROOM_BYTES` as a share of the GPU (at most 0.95).

    Example: 16 GiB of weights, 8 GiB of KV cache on an 80 GiB GPU: 26 / 80 = 0.325."""
    return min(0.95, (weights_bytes + kv_bytes + CUDA_HEADROOM_BYTES) / total_bytes)


def vllm_sampling(p: SamplingParams, n: int, first_index: int) -> list:
    """vLLM's ``SamplingParams`` of each of ``n`` sequences (global indices from
    ``first_index``): see the module docstring."""
    from vllm import SamplingParams as VSP

    common = dict(max_tokens=p.max_new_tokens, logprobs=0, ignore_eos=True,
                  stop_token_ids=list(p.stop_token_ids), skip_special_tokens=False,
                  detokenize=False)
    if p.greedy:
        return [VSP(temperature=0.0, **common)] * n
    return [VSP(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                seed=p.seed + first_index + i, **common) for i in range(n)]


def cpu_bind(cores: list[int], tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` vLLM CPU workers: ``nobind`` for one
    (its threads share the cores as the realign workers do), else the cores split into
    ``tp`` consecutive sets, one per worker.

    Example: cores 0..3, tp 2 -> ``"0-1|2-3"``; cores 0, 1, tp 2 -> ``"0|1"``."""
    if tp == 1:
        return "nobind"
    if len(cores) < tp:
        raise ValueError(f"vLLM at TP {tp} on CPU needs {tp} cores, this process may use "
                         f"{len(cores)}")
    per = len(cores) // tp
    sets = [cores[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(str(c[0]) if len(c) == 1 else f"{c[0]}-{c[-1]}" for c in sets)


@contextlib.contextmanager
def child_env(device_kind: str, devices: list[int], tp: int):
    """The environment vLLM's child processes start with (restored after)."""
    threads = torch.get_num_threads()
    bind = cpu_bind(sorted(os.sched_getaffinity(0)), tp) if device_kind == "cpu" else "nobind"
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_CPU_OMP_THREADS_BIND": bind,
           # one worker: as many threads as this worker has
           "OMP_NUM_THREADS": str(threads)}
    if device_kind == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(child_visible_devices(visible, i)
                                               for i in devices)
    old = {k: os.environ.get(k) for k in [*env, "VLLM_CPU_KVCACHE_SPACE"]}
    os.environ.update(env)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)     # kv_cache_memory_bytes rules
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VLLMEngine:
    """One vLLM engine of a replica's data-parallel rank, hosted on its TP rank 0 (see
    the module docstring). ``tp``: the call's TP; ``host``: this rank hosts the engine
    (the other TP ranks hold ``llm = None``); ``devices``: the local device index of
    each TP rank (CUDA); ``lora``: the replica's :class:`~planner.specs.lora.LoraSpec`
    (None: no LoRA)."""

    def __init__(self, model_dir: str | Path, settings: VLLMSettings, dtype: torch.dtype,
                 max_model_len: int, device_kind: str = "cpu", device_index: int = 0,
                 seed: int = 0, tp: int = 1, host: bool = True,
                 devices: list[int] | None = None,
                 bucket_bytes: int = BUCKET_BYTES, lora=None, moe_top_k: int = 0):
        self.kv_cache_bytes = int(settings.kv_cache_gib * GIB)
        self.device_kind, self.tp, self.bucket_bytes = device_kind, tp, bucket_bytes
        self.devices = devices if devices is not None else [device_index + i for i in range(tp)]
        self.llm = None
        self.backend = "shm" if device_kind == "cpu" else "ipc"
        self.transport: WeightTransport | None = None
        self._folder: Path | None = None
        self.adapters: VLLMAdapters | None = None
        self.enforce_eager = vllm_eager(device_kind)
        #: whether the engine records its routing (the same on every rank of the replica)
        self.records_routing = records_routing(moe_top_k, self.enforce_eager)
        #: the experts vLLM routed each token to (:attr:`records_routing`, on the host)
        self.routing: VLLMRouting | None = None
        config = peft_config(lora, "lm", str(model_dir)) if lora is not None else {}
        if not host:
            if lora is not None:
                self.adapters = VLLMAdapters(None, config)
            return
        from vllm import LLM

        threads = torch.get_num_threads()
        extra: dict = {}
        if device_kind == "cuda":
            from vllm.config import WeightTransferConfig

            weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / tp
            extra["gpu_memory_utilization"] = cuda_memory_share(
                weights, self.kv_cache_bytes, torch.cuda.mem_get_info(device_index)[1])
            from realign.runtime.engines.vllm_cuda_weights import cuda_backend

            # the workers run on the devices given: the replica's own, so IPC (realign's
            # worker extension); vLLM's NCCL engine where they are not
            self.backend = cuda_backend(self.devices, self.devices)
            if self.backend == "nccl":
                extra["weight_transfer_config"] = WeightTransferConfig(backend="nccl")
        with child_env(device_kind, self.devices, tp):
            self.llm = LLM(model=str(model_dir), dtype=dtype, seed=seed,
                           tensor_parallel_size=tp,
                           distributed_executor_backend="uni" if tp == 1 else "mp",
                           worker_extension_cls=WORKER_EXTENSION,
                           enforce_eager=self.enforce_eager, skip_tokenizer_init=True,
                           max_model_len=max_model_len, max_num_seqs=settings.max_num_seqs,
                           kv_cache_memory_bytes=self.kv_cache_bytes,
                           enable_prefix_caching=False, **lora_engine_args(lora), **extra)
        torch.set_num_threads(threads)          # vLLM lowers the caller's threads
        if lora is not None:
            self.adapters = VLLMAdapters(self.llm.collective_rpc, config)
        if self.records_routing:
            self.routing = VLLMRouting(self.llm, moe_top_k)

    # ---- weights -----------------------------------------------------------------------
    def _transport(self, shard: ModelShard | None) -> WeightTransport:
        """The transport, made on the first load (a collective over the replica's TP
        group on CUDA, where the ranks exchange their GPUs)."""
        if self.transport is None:
            if self.device_kind == "cpu":
                cap = self.bucket_bytes
                if shard is not None:
                    elem = next(shard.module.parameters()).element_size()
                    cap = bucket_capacity([group_bytes(shard, grp, elem)
                                           for grp in weight_groups(shard)], self.bucket_bytes)
                self.transport = SharedMemoryTransport(
                    self.llm.collective_rpc if self.llm is not None else None, cap)
            else:
                from realign.runtime.engines.vllm_cuda_weights import cuda_transport

                self.transport = cuda_transport(self.llm, shard, self.bucket_bytes,
                                                self.backend)
        return self.transport

    def load(self, shard: ModelShard) -> int:
        """Replace the engine's weights by ``shard``'s (the call's layout, PP 1), in
        memory; the bytes delivered (whole tensors). With LoRA only the adapters, under
        a new id. Every TP rank of the replica calls it."""
        g = shard.groups
        assert g.layout.pp == 1 and g.layout.tp == self.tp, \
            f"vLLM runs at the call's TP {self.tp}, PP 1; the replica is at {g.layout}"
        if self.adapters is not None:       # LoRA: the adapters only, the base stays
            return self.adapters.push(shard)
        nbytes = push_weights(shard, self._transport(shard), self.bucket_bytes)
        if self.llm is not None:
            self.llm.reset_prefix_cache()
        return nbytes

    def load_hf(self, hf: dict[str, torch.Tensor]) -> int:
        """Replace the engine's weights by ``hf`` (Hugging Face names, whole tensors, a
        hosting rank alone: ``realign profile``'s probes), in memory; the bytes."""
        assert self.llm is not None
        if self.transport is None and self.device_kind == "cpu":
            sizes = [t.numel() * t.element_size() for t in hf.values()]
            self.transport = SharedMemoryTransport(
                self.llm.collective_rpc, max(self.bucket_bytes, sum(sizes)))
        nbytes = push_hf(hf, self._transport(None), self.bucket_bytes)
        self.llm.reset_prefix_cache()
        return nbytes

    def load_files(self, hf: dict[str, torch.Tensor]) -> int:
        """The file route, for comparison: ``hf`` written as safetensors to a folder in
        shared memory and reloaded by vLLM from there; the bytes written."""
        from safetensors.torch import save_file

        assert self.llm is not None
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(
                prefix="realign-vllm-", dir=SHARED_MEMORY if SHARED_MEMORY.is_dir() else None))
        save_file(hf, str(self._folder / "model.safetensors"))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._folder)})
        self.llm.collective_rpc("realign_repack_experts")   # a mixture of experts on CPU
        self.llm.reset_prefix_cache()
        return sum(v.numel() * v.element_size() for v in hf.values())

    # ---- generation --------------------------------------------------------------------
    def generate(self, shard: ModelShard, prompts: list[list[int]], p: SamplingParams,
                 pad_id: int) -> Generation:
        """Continuations of ``prompts`` (every rank of the replica passes them all and
        gets the whole result): this data-parallel rank's engine generates its share,
        which its TP rank 0 sends to the other TP ranks."""
        g = shard.groups
        per = len(prompts) // g.layout.dp
        first = g.dp_rank * per
        mine = prompts[first:first + per]
        n = p.max_new_tokens
        dev = shard.device.device
        local = torch.zeros(len(mine), 2 * n + 1, dtype=torch.float64)
        if self.llm is not None:
            local = self._generate(mine, p, first, pad_id)
        local = local.to(dev)
        if g.layout.tp > 1:
            import torch.distributed as dist

            dist.broadcast(local, src=g.world_rank(0, g.dp_rank, g.pp_rank), group=g.pgs.tp)
        out = gather_dp(shard, local)
        return Generation(tokens=out[:, :n].long(), logprobs=out[:, n:2 * n].float(),
                          lengths=out[:, 2 * n].long(), kv_cache_peak_bytes=self.kv_cache_bytes)

    def _generate(self, mine: list[list[int]], p: SamplingParams, first: int,
                  pad_id: int) -> torch.Tensor:
        """The engine's records of ``mine``: tokens, log-probs, length per row."""
        assert self.llm is not None
        lora = self.adapters.request() if self.adapters is not None else None
        outs = self.llm.generate([{"prompt_token_ids": q} for q in mine],
                                 vllm_sampling(p, len(mine), first), use_tqdm=False,
                                 lora_request=lora)
        if self.routing is not None:
            self.routing.take(outs, mine)
        n = p.max_new_tokens
        tokens = torch.full((len(mine), n), pad_id, dtype=torch.float64)
        logprobs = torch.zeros(len(mine), n, dtype=torch.float64)
        lengths = torch.zeros(len(mine), 1, dtype=torch.float64)
        for i, o in enumerate(outs):
            c = o.outputs[0]
            ids = list(c.token_ids)[:n]
            tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.float64)
            logprobs[i, :len(ids)] = torch.tensor(
                [step[t].logprob for t, step in zip(ids, c.logprobs)], dtype=torch.float64)
            lengths[i, 0] = len(ids)
        return torch.cat([tokens, logprobs, lengths], dim=1)

    def close(self) -> None:
        """Stop the engine's child processes (vLLM's engine core client) and release
        the transport's buffers and the file route's folder."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.adapters is not None:
            self.adapters.close()
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown(timeout=CLOSE_TIMEOUT_S)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
