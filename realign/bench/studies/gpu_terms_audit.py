"""The GPU terms of the cost model against the public measurements they rest on.

    python -m realign.bench.studies.gpu_terms_audit > benchmarks/gpu_terms/audit_<date>.md

For each term that dominates a large plan, the cost model (device presets, no profile)
prices the setting of a public measurement of docs/gpu-facts.md, and the two are put
side by side; then the terms of the 4 x 70B PPO on 128 H100 (experiments/
ppo-llama2-70b-128gpu.yaml) are listed. Pure planning: it runs anywhere, in seconds.
"""
from __future__ import annotations

from planner.cost.cost_config import CostModelConfig
from planner.cost.cost_model import CostModel
from planner.cost.engine_terms import Work
from planner.cost.passes import decode_iteration
from planner.graph.dataflow import MFC
from planner.specs.cluster import ClusterSpec, resolve_device
from planner.specs.layout import Layout
from planner.specs.mesh import DeviceMesh
from planner.specs.model_spec import model_presets
from realign.bench.studies.checkout import REPO

P = model_presets()


def cm(device: str, nodes: int = 1, gpn: int = 8, host_free: bool = False,
       capture: str = "auto") -> CostModel:
    """The preset's cost model; ``host_free``: with the host's fixed costs of realign's
    engines at 0 (what an engine whose host keeps ahead of the device reaches);
    ``capture``: the own engine's decode step captured (auto, on) or eager (off)."""
    dev = resolve_device(device)
    if host_free:
        dev = dev.model_copy(update={"decode_layer_overhead_s": 0.0, "layer_overhead_s": 0.0,
                                     "microbatch_overhead_s": 0.0, "call_overhead_s": 0.0})
    return CostModel(ClusterSpec(n_nodes=nodes, gpus_per_node=gpn, device=dev),
                     CostModelConfig(decode_capture=capture))


def decode_ms_per_token(device: str, model: str, tp: int, batch: int = 1,
                        prompt: int = 16, new: int = 128) -> tuple[float, float]:
    """(per-token ms of a decode step, the same without the host's fixed costs)."""
    m = MFC(name="g", role="actor", kind="generate", n_seqs=batch, prompt_len=prompt,
            gen_len=new, input_keys=("p",), output_keys=("s",))
    out = []
    for free in (False, True):
        c = cm(device, host_free=free, capture="off").mfc_cost(m, P[model], "lm",
                                                DeviceMesh(first_gpu=0, n_gpus=tp), Layout(tp=tp), 1)
        out.append(1e3 * sum(v for k, v in c.terms_s.items() if k.startswith("decode_"))
                   / (new - 1))
    return out[0], out[1]


def captured_step_ms(device: str, model: str, rows: int, ctx: float) -> float:
    """ms of one captured decode step of ``rows`` rows over ``ctx`` keys on one device."""
    c = cm(device, gpn=1, capture="on")
    stages = c.stage_works(P[model], "lm", "decode", rows, ctx, rows, Layout(), 1, Work())
    costs = c.rates.engine("decode")
    return 1e3 * decode_iteration(stages, 1, costs).total(costs)


def prefill_ms(device: str, model: str, tp: int, tokens: int) -> float:
    m = MFC(name="g", role="actor", kind="generate", n_seqs=1, prompt_len=tokens, gen_len=1,
            input_keys=("p",), output_keys=("s",))
    c = cm(device).mfc_cost(m, P[model], "lm", DeviceMesh(first_gpu=0, n_gpus=tp),
                            Layout(tp=tp), 1)
    return 1e3 * sum(v for k, v in c.terms_s.items() if k.startswith("prefill_"))


def train_tflops_per_gpu(device: str, model: str, tp: int, pp: int, dp: int, seq: int,
                         batch: int, micro: int, recompute: bool = False) -> float:
    """6 N tokens / step time / GPUs (the public tables' model FLOPs, by 6N)."""
    n = tp * pp * dp
    nodes = max(1, n // 8)
    m = MFC(name="t", role="actor", kind="train", n_seqs=batch, prompt_len=seq - 1, gen_len=1,
            input_keys=("x",), output_keys=("y",))
    c = cm(device, nodes=nodes).mfc_cost(m, P[model], "lm", DeviceMesh(first_gpu=0, n_gpus=n),
                                         Layout(tp=tp, pp=pp, dp=dp), micro, recompute=recompute)
    flops = 6 * P[model].total_params("lm") * batch * seq
    return flops / c.time_s / n / 1e12


def busbw(device: str, op: str, nbytes: float, n: int, nodes: int = 1) -> float:
    from planner.cost.rates import alg_factor
    r = cm(device, nodes=nodes).rates
    return alg_factor(op, n) * nbytes / r.collective_s(op, nbytes, n, nodes) / 1e9


def row(term: str, setting: str, public: str, ours: str, note: str) -> str:
    return f"| {term} | {setting} | {public} | {ours} | {note} |"


def main() -> None:
    print("| term | setting | public measurement (docs/gpu-facts.md) | realign's estimate | note |")
    print("|---|---|---|---|---|")
    t, mem = decode_ms_per_token("a100-80g", "llama2-7b", 1)
    print(row("decode step (eager host loop, rollout.capture: off)", "LLaMA-2 7B, 1 A100, batch 1",
              "39 ms/token, a naive eager PyTorch loop (§3a)", f"{t:.1f} ms/token",
              "realign's decode loop is eager, as that one; the host's per-layer cost is its "
              "term (decode_layer_overhead_s)"))
    print(row("decode step (weights streamed)", "LLaMA-2 7B, 1 A100, batch 1",
              "10 ms/token, lmdeploy (66 % of HBM) (§3a)", f"{mem:.1f} ms/token",
              "the same step without the host's fixed costs: the weights streamed from HBM"))
    t, mem = decode_ms_per_token("a100-80g", "llama2-70b", 4)
    print(row("decode step (weights streamed, TP)", "LLaMA-2 70B, TP4 A100, batch 1",
              "29.5 ms/token, lmdeploy (57 %) (§3a)", f"{mem:.1f} ms/token (with host: {t:.1f})",
              "TP all-reduces per layer included"))
    for rows, measured in ((64, "10.97 / 11.04"), (256, "21.56 / 21.37")):
        t = captured_step_ms("h100-80g", "llama3-8b", rows, 1003)
        print(row("decode step (captured, weights and KV cache streamed)",
                  f"LLaMA-3 8B shape, 1 H100, {rows} rows over ~1000 keys",
                  f"{measured} ms, realign's own captured step on two machines "
                  "(benchmarks/gpu/README.md, §3e)", f"{t:.2f} ms",
                  "weights at mem_bw_efficiency, the KV cache at kv_read_bw_efficiency"))
    pf = prefill_ms("a100-80g", "llama2-70b", 4, 2048)
    print(row("prefill", "LLaMA 70B, TP4 A100, 2048 tokens", "377 ms TTFT, TRT-LLM (§3d)",
              f"{pf:.0f} ms", ""))
    pf = prefill_ms("a100-80g", "llama2-7b", 1, 2048)
    print(row("prefill", "LLaMA 7B, 1 A100, 2048 tokens", "133 ms TTFT, TRT-LLM; 139 ms lmdeploy (§3d)",
              f"{pf:.0f} ms", ""))
    tf = train_tflops_per_gpu("h100-80g", "llama2-70b", 8, 2, 1, 4096, 32, 32)
    print(row("training (PP bubbles, TP)", "70B, TP8 PP2, H100, seq 4096, 32 micro-batches of 1",
              "419.7 TF/GPU (42 %), Megatron-core, 768 GPUs (§2a)", f"{tf:.0f} TF/GPU (by 6N)",
              "realign prices its own schedule (1F1B, no interleaving)"))
    tf = train_tflops_per_gpu("h100-80g", "llama2-7b", 2, 1, 4, 4096, 192, 48)
    print(row("training", "7B, TP2 DP4, H100, seq 4096", "465.9 TF/GPU (47 %), Megatron-core 7.1B TP2 (§2a)",
              f"{tf:.0f} TF/GPU", ""))
    for nbytes, public in ((128e6, "401 GB/s"), (1e9, "466 GB/s"), (16e6, "237 GB/s")):
        bw = busbw("h100-80g", "all_reduce", nbytes, 8)
        print(row("TP / DP all-reduce", f"8 x H100, {nbytes / 1e6:.0f} MB",
                  f"busbw {public} (NVLS; ~370 without) (§4)", f"busbw {bw:.0f} GB/s", ""))
    bw = busbw("h100-80g", "all_reduce", 1e9, 16, nodes=2)
    print(row("all-reduce across nodes", "16 x H100 on 2 nodes (8 x 400G), 1 GB",
              "busbw ~330-380 GB/s (§4)", f"busbw {bw:.0f} GB/s", ""))
    r = cm("h100-80g").rates
    p2p = 1e9 / r.collective_s("p2p", 1e9, 2) / 1e9
    print(row("PP p2p", "2 H100 in a node, 1 GB", "380 GB/s one direction (p2pBandwidthLatencyTest) (§4)",
              f"{p2p:.0f} GB/s", ""))
    rx = cm("h100-80g", nodes=2).rates
    p2px = 1e9 / rx.collective_s("p2p", 1e9, 2, nodes=2) / 1e9
    print(row("PP p2p across nodes", "2 H100 on 2 nodes, 1 GB", "46-48 GB/s per NDR NIC (§4)",
              f"{p2px:.1f} GB/s", ""))
    print(row("reallocation", "any", "no public measurement of a dense reshard alone (§6: NeMo RL's "
              "MoE refit, 10-20 % of a step)", "links and latencies: the slices each GPU receives "
              "over NVLink / the NICs", "unanchored: its per-tensor cost on a GPU is unmeasured"))
    print(row("offload transfers", "PCIe 5.0 x16", "not in docs/gpu-facts.md",
              f"{resolve_device('h100-80g').host_link_bytes_per_s / 1e9:.0f} GB/s per direction",
              "unanchored (the preset's sources say so)"))

    plan_terms()


def plan_terms() -> None:
    """Each call's terms in the 4 x 70B PPO on 128 H100 (the searched plan)."""
    from realign.run.loading import load_experiment
    from realign.run.planning import plan_experiment, resolve_models

    cfg = load_experiment(REPO / "experiments" / "ppo-llama2-70b-128gpu.yaml")
    plan = plan_experiment(cfg)
    models = resolve_models(cfg)
    cost = CostModel(plan.cluster, plan.cost_config)
    print()
    print(f"The searched plan of experiments/ppo-llama2-70b-128gpu.yaml: "
          f"{plan.iteration_time_s:.1f} s a step. Each call's terms (s):")
    print()
    print("| call | layout | micro | time | terms over 1 % of it |")
    print("|---|---|---|---|---|")
    for a in plan.allocations:
        m = plan.graph.mfc(a.mfc)
        c = cost.mfc_cost(m, models[m.role].spec, models[m.role].head, a.mesh, a.layout,
                          a.micro_batches, a.optimizer_offload, a.train_state_offload,
                          a.activation_recompute)
        big = ", ".join(f"{k} {v:.3f}" for k, v in sorted(c.terms_s.items(), key=lambda x: -x[1])
                        if v > 0.01 * c.time_s)
        print(f"| {a.mfc} | {a.layout} | {a.micro_batches} | {c.time_s:.2f} | {big} |")
    for r in plan.reallocations:
        print(f"| realloc {r.role} -> {r.to_mfc} | {r.src_layout} -> {r.dst_layout} | | "
              f"{r.time_s:.3f} | {r.bytes / 2**30:.0f} GiB moved in all |")


if __name__ == "__main__":
    main()
