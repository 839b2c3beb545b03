"""vLLM's fixed costs, measured where vLLM is installed (``.venv-vllm/bin/realign
profile``): vLLM generates on probe models and the ``vllm_prefill`` and
``vllm_decode`` :class:`~planner.cost.profile.EngineCosts` (and ``vllm_load``, the
weight load's fixed seconds and bytes per second) are fitted through the
planner's own pricing of a vLLM call (:mod:`planner.cost.vllm_cost`), as realign's
engines are (:func:`realign.profile.run.fit_engines`).

The probes run one engine (:class:`~realign.runtime.engines.vllm_engine.VLLMEngine`,
its core in a child process) per probe model in the profiling process, with the
workers' thread count, while no worker runs. Every response runs to its length (no
stop token), so the decode steps are known exactly. The probe models have heads of 32
channels (vLLM's CPU kernels take no fewer).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from planner.cost.cost_model import CostModel
from planner.cost.engine_terms import FIXED
from planner.cost.profile import EngineCosts, ProbePoint, ProfileTable
from planner.cost.vllm_cost import VLLM_DECODE, VLLM_PREFILL
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import ModelSpec
from realign.profile.fit import fit_relative, fit_transfer

#: (layers, hidden, vocabulary) of the probe models: heads of 32, FFN twice the width;
#: the widest makes arithmetic dominate its steps (how fast vLLM's own kernels run
#: against the GEMM grid: ``kernel_extra``)
VLLM_PROBE_MODELS = ((2, 128, 128), (4, 256, 1024), (4, 512, 1024))
#: (prompts, prompt tokens, generated tokens; 1: the prefill alone)
VLLM_BATCHES = ((4, 8, 1), (64, 16, 1), (4, 8, 16), (32, 8, 16), (64, 8, 8), (16, 16, 32))
#: timed runs of each probe (after one untimed)
VLLM_REPS = 5
#: beyond this relative error a probe weighs linearly in the fit (Huber)
FIT_HUBER = 0.1


def vllm_probe_spec(layers: int, hidden: int, vocab: int) -> ModelSpec:
    heads = hidden // 32
    return ModelSpec(name=f"vllm-probe-{layers}x{hidden}v{vocab}", n_layers=layers,
                     hidden=hidden, n_heads=heads, n_kv_heads=max(1, heads // 2),
                     ffn_hidden=2 * hidden, vocab_size=vocab, max_seq_len=256)


def _write_model(folder: Path, spec: ModelSpec, dtype: str) -> Path:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden,
                         intermediate_size=spec.ffn_hidden, num_hidden_layers=spec.n_layers,
                         num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads,
                         max_position_embeddings=spec.max_seq_len, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        model = tf.LlamaForCausalLM(cfg).to(dt)
    model.save_pretrained(str(folder))
    return folder


def _probe_mfc(b: int, prompt: int, n: int) -> MFC:
    return MFC(name="probe.vllm", role="actor", kind="generate", n_seqs=b, prompt_len=prompt,
               gen_len=n, input_keys=("x",), output_keys=("y",))


def time_vllm(device: str, dtype: str, threads: int
              ) -> tuple[list[tuple[tuple, tuple, float]], list[tuple[float, float, float, float]]]:
    """``[(probe model, (prompts, prompt tokens, generated), median seconds)]``, and the
    weight loads ``[(0, tensors, bytes, median seconds)]`` of each probe model."""
    import torch
    from safetensors.torch import load_file

    from realign.runtime.engines.vllm_engine import VLLMEngine, vllm_sampling
    from realign.runtime.settings import SamplingParams, VLLMSettings

    torch.set_num_threads(threads)
    out, loads = [], []
    with tempfile.TemporaryDirectory(prefix="realign-vllm-probe-") as tmp:
        for dims in VLLM_PROBE_MODELS:
            spec = vllm_probe_spec(*dims)
            folder = _write_model(Path(tmp) / spec.name, spec, dtype)
            engine = VLLMEngine(folder, VLLMSettings(kv_cache_gib=1, max_num_seqs=256),
                                torch.bfloat16 if dtype == "bf16" else torch.float32,
                                max_model_len=64, device_kind=device)
            try:
                weights = load_file(str(folder / "model.safetensors"))
                times = []
                for rep in range(VLLM_REPS + 1):
                    t0 = time.perf_counter()
                    nbytes = engine.load_hf(weights)
                    if rep:
                        times.append(time.perf_counter() - t0)
                loads.append((0.0, float(len(weights)), float(nbytes), statistics.median(times)))
                g = torch.Generator().manual_seed(7)
                for b, p, n in VLLM_BATCHES:
                    prompts = [{"prompt_token_ids": row} for row in
                               torch.randint(3, spec.vocab_size, (b, p), generator=g).tolist()]
                    sampling = vllm_sampling(SamplingParams(max_new_tokens=n, seed=1), b, 0)
                    times = []
                    for rep in range(VLLM_REPS + 1):
                        t0 = time.perf_counter()
                        assert engine.llm is not None, "a VLLMEngine starts its LLM when built"
                        engine.llm.generate(prompts, sampling, use_tqdm=False)
                        if rep:
                            times.append(time.perf_counter() - t0)
                    out.append((dims, (b, p, n), statistics.median(times)))
            finally:
                engine.close()
    return out, loads


def fit_vllm(base: ProfileTable, cluster: ClusterSpec, dtype_bytes: int,
             measured: list[tuple[tuple, tuple, float]]
             ) -> tuple[dict[str, EngineCosts], float, list[float]]:
    """vLLM's fixed costs that best explain ``measured`` through the planner's pricing
    of a vLLM call (one engine: DP 1); the fit's RMS relative error; each probe's fitted
    seconds. The call's weight copy into vLLM is not part of these probes (they
    generate only), so it is taken out of the price they are fitted to."""
    from planner.cost.cost_config import CostModelConfig

    cfg = CostModelConfig(param_dtype_bytes=dtype_bytes, distributed_optimizer=False,
                          generate_engine="vllm")
    one = cluster.model_copy(update={"gpus_per_node": 1, "n_nodes": 1, "device": cluster.device.model_copy(
        update={"async_kernels": False})})
    zero = {k: EngineCosts() for k in (VLLM_PREFILL, VLLM_DECODE)}
    unknowns = [(k, f) for k in zero for f in FIXED]

    def price(engines: dict[str, EngineCosts]) -> list[float]:
        cm = CostModel(one, cfg, base.model_copy(update={"engines": {**base.engines, **engines}}))
        out = []
        for dims, (b, p, n), _t in measured:
            c = cm.mfc_cost(_probe_mfc(b, p, n), vllm_probe_spec(*dims), "lm",
                            DeviceMesh(first_gpu=0, n_gpus=1), Layout(tp=1, pp=1, dp=1), 1,
                            engine="vllm")
            out.append(c.time_s - c.terms_s["weight_load"])
        return out
    t0 = price(zero)
    cols = []
    for k, f in unknowns:
        unit = price({**zero, k: zero[k].model_copy(update={f: 1.0})})
        cols.append([u - z for u, z in zip(unit, t0)])
    A = [[c[i] for c in cols] for i in range(len(measured))]
    coef, rms = fit_relative(A, [t for *_, t in measured], t0, huber=FIT_HUBER)
    costs = {k: zero[k].model_copy(update={f: c for (kk, f), c in zip(unknowns, coef) if kk == k})
             for k in zero}
    pred = [z + sum(a * c for a, c in zip(row, coef)) for z, row in zip(t0, A)]
    return costs, rms, pred


def probe_points(measured: list[tuple[tuple, tuple, float]], pred: list[float]
                 ) -> list[ProbePoint]:
    return [ProbePoint(engine="vllm", model=dims, layout=(1, 1, 1), args=(b, p, n, 1),
                       measured_s=t, fitted_s=f)
            for (dims, (b, p, n), t), f in zip(measured, pred)]


def fit_vllm_load(loads: list[tuple[float, float, float, float]]):
    """``fixed_s + bytes / bytes_per_s`` of a weight load (per tensor: not fitted)."""
    costs = fit_transfer([(e, 0.0, b, t) for e, _n, b, t in loads])
    return costs.model_copy(update={"per_tensor_s": 0.0})
