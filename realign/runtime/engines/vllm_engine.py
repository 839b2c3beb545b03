"""Generation on vLLM: one engine per worker of a generate call that the plan runs on
vLLM (``engine: vllm``), fed the replica's own weights before each call.

The engine is vLLM's ``LLM`` in its multi-process mode: its engine core is a child
process of the realign worker (started with ``spawn``), so vLLM's own
``torch.distributed`` world stays apart from the worker's (a single-process engine
would build its groups over the worker's world, a collective the other workers never
join). The worker is the engine's only client; nothing else manages it.

* **Weights** (:meth:`VLLMEngine.load`): the replica's parameters (TP 1, PP 1: whole
  tensors on this rank, after the plan's reallocation when the call's layout differs
  from training's) are converted to Hugging Face names
  (:func:`realign.runtime.hf_checkpoint.to_hf`), written to a folder in shared memory
  and loaded in place by vLLM's ``reload_weights``; its prefix cache is reset.
* **Sampling** (:meth:`VLLMEngine.generate`): realign's settings map one to one
  (temperature, top-k, top-p; greedy is temperature 0); the stop tokens are realign's
  (the tokenizer's end token; vLLM's own end-of-sequence rule is off, so both engines
  stop alike) and are kept in the output; each sequence's seed is the call's seed plus
  its index in the call. The log-probs are vLLM's raw ones (``logprobs_mode``
  ``raw_logprobs``): the model's own distribution at temperature 1, what realign's
  engine returns and the training forward computes.
* **Records**: tokens padded with ``pad_id`` after the end, log-probs 0 there, lengths
  with the stop token: :class:`~realign.runtime.engines.generate.Generation`, as
  realign's engine returns, gathered over the data-parallel ranks.

CUDA: the same code (``enforce_eager`` off, so decode runs as CUDA graphs; the KV cache
is ``kv_cache_memory_bytes`` on the worker's GPU, which the child is shown alone; vLLM
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

from planner.specs.param_layout import stage_tensors
from realign.runtime.engines.base import gather_dp
from realign.runtime.engines.generate import Generation
from realign.runtime.model import ModelShard
from realign.runtime.settings import SamplingParams, VLLMSettings

GIB = 2 ** 30
#: how long closing waits for vLLM's child processes to end
CLOSE_TIMEOUT_S = 10.0
#: where the weights go between realign and vLLM (a tmpfs where there is one)
SHARED_MEMORY = Path("/dev/shm")


def child_visible_devices(visible: str | None, index: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the engine's child: only the worker's own GPU, the
    ``index``-th of those the worker sees.

    Example: ``"4,5,6,7"``, 1 -> ``"5"``; unset, 3 -> ``"3"``."""
    if visible:
        return visible.split(",")[index].strip()
    return str(index)


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


@contextlib.contextmanager
def _child_env(settings: VLLMSettings, device_kind: str, device_index: int):
    """The environment vLLM's child processes start with (restored after)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           # share the cores as the workers do; as many threads as this worker has
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    if device_kind == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = child_visible_devices(
            os.environ.get("CUDA_VISIBLE_DEVICES"), device_index)
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
    """One vLLM engine of a replica on this rank (see the module docstring)."""

    def __init__(self, model_dir: str | Path, settings: VLLMSettings, dtype: torch.dtype,
                 max_model_len: int, device_kind: str = "cpu", device_index: int = 0,
                 seed: int = 0):
        from vllm import LLM

        threads = torch.get_num_threads()
        kv = int(settings.kv_cache_gib * GIB)
        extra = {}
        if device_kind == "cuda":
            weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
            extra["gpu_memory_utilization"] = cuda_memory_share(
                weights, kv, torch.cuda.mem_get_info(device_index)[1])
        with _child_env(settings, device_kind, device_index):
            self.llm = LLM(model=str(model_dir), dtype=dtype, seed=seed,
                           distributed_executor_backend="uni",
                           enforce_eager=device_kind == "cpu", skip_tokenizer_init=True,
                           max_model_len=max_model_len, max_num_seqs=settings.max_num_seqs,
                           kv_cache_memory_bytes=kv, enable_prefix_caching=False, **extra)
        torch.set_num_threads(threads)          # vLLM lowers the caller's threads
        self.kv_cache_bytes = int(settings.kv_cache_gib * GIB)
        self._folder = Path(tempfile.mkdtemp(
            prefix="realign-vllm-", dir=SHARED_MEMORY if SHARED_MEMORY.is_dir() else None))

    # ---- weights -----------------------------------------------------------------------
    def load(self, shard: ModelShard) -> int:
        """Replace the engine's weights by ``shard``'s (TP 1, PP 1); the bytes written."""
        from realign.runtime.hf_checkpoint import to_hf
        from realign.runtime.model import logical_shards

        g = shard.groups
        assert g.layout.tp == 1 and g.layout.pp == 1, "vLLM takes whole tensors (TP 1, PP 1)"
        tensors = {t.name: t for t in stage_tensors(shard.spec, shard.head, 1, 0)}
        hf: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, local in logical_shards(shard, g.layout, 0).items():
                t = tensors[name]
                if name == "output_layer.weight" and t.content == "embedding":
                    continue                     # tied: the embedding is the head
                hf.update({k: v.detach().cpu() for k, v in to_hf(t, local, shard.spec).items()})
        return self.load_hf(hf)

    def load_hf(self, hf: dict[str, torch.Tensor]) -> int:
        """Replace the engine's weights by ``hf`` (Hugging Face names, whole tensors):
        written to shared memory, reloaded in place; the bytes written."""
        from safetensors.torch import save_file

        save_file(hf, str(self._folder / "model.safetensors"))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._folder)})
        self.llm.reset_prefix_cache()
        return sum(v.numel() * v.element_size() for v in hf.values())

    # ---- generation --------------------------------------------------------------------
    def generate(self, shard: ModelShard, prompts: list[list[int]], p: SamplingParams,
                 pad_id: int) -> Generation:
        """Continuations of ``prompts`` (every rank of the replica passes them all and
        gets the whole result): this data-parallel rank generates its share."""
        g = shard.groups
        per = len(prompts) // g.layout.dp
        first = g.dp_rank * per
        mine = prompts[first:first + per]
        outs = self.llm.generate([{"prompt_token_ids": q} for q in mine],
                                 vllm_sampling(p, len(mine), first), use_tqdm=False)
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
        dev = shard.device.device
        out = gather_dp(shard, torch.cat([tokens, logprobs, lengths], dim=1).to(dev))
        return Generation(tokens=out[:, :n].long(), logprobs=out[:, n:2 * n].float(),
                          lengths=out[:, 2 * n].long(), kv_cache_peak_bytes=self.kv_cache_bytes)

    def close(self) -> None:
        """Stop the engine's child processes (vLLM's engine core client) and remove its
        weights folder."""
        self.llm.llm_engine.engine_core.shutdown(timeout=CLOSE_TIMEOUT_S)
        shutil.rmtree(self._folder, ignore_errors=True)
