"""A sparse layer's experts in their two forms (realign.runtime.moe_experts): the dense
form (every expert on every token, one batched matmul) and the sorted form (each expert
on its sorted rows) equal a per-expert reference loop (fp32, 1e-5) at decode and
prefill shapes, with gradients, and on TP1 and TP2 replicas of a tiny Qwen3-MoE with the
same routing; the dense form reads nothing on the host (guarded host reads raise, and
torch.compile traces a decode step's layer as one graph); a MoE decoder's traced decode
steps equal its eager steps."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from realign.runtime.moe import moe_forward, route
from realign.runtime.moe_experts import (
    DENSE_MAX_TOKENS,
    dense_experts,
    experts_dense,
    experts_sorted,
)

TOL = 1e-5


def reference(x, weights, experts, fc1s, fc2s):
    """transformers' Qwen3MoeSparseMoeBlock loop: each expert hit, its tokens found on
    the host."""
    out = torch.zeros(x.shape[0], next(iter(fc2s.values())).shape[0], dtype=x.dtype)
    for e in torch.unique(experts).tolist():
        token, slot = torch.where(experts == e)
        gate, up = F.linear(x[token], fc1s[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, fc2s[e])
        out = out.index_add(0, token, h * weights[token, slot, None])
    return out


def problem(tokens, n_experts=8, top_k=2, h=32, f=24, o=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=g)
    router = torch.randn(n_experts, h, generator=g)
    fc1s = {e: torch.randn(2 * f, h, generator=g) * 0.2 for e in range(n_experts)}
    fc2s = {e: torch.randn(o, f, generator=g) * 0.2 for e in range(n_experts)}
    weights, experts = route(x, router, top_k, True)
    return x, router, weights, experts, fc1s, fc2s


@contextlib.contextmanager
def host_reads_raise():
    """Every way a tensor's values reach the host in these forms raises."""
    def refuse(*args, **kwargs):
        raise RuntimeError("host read")
    patched = [(torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch.Tensor, "nonzero"),
               (torch.Tensor, "__bool__"), (torch, "unique"), (torch, "nonzero")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patched]
    for obj, name in patched:
        setattr(obj, name, refuse)
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


@pytest.mark.pure
def test_the_form_follows_the_tokens_count_only():
    assert dense_experts(1) and dense_experts(64) and dense_experts(DENSE_MAX_TOKENS)
    assert not dense_experts(DENSE_MAX_TOKENS + 1) and not dense_experts(16 * 100)


@pytest.mark.pure
@pytest.mark.parametrize("tokens,n_experts,top_k", [
    (1, 8, 2), (5, 8, 2), (64, 64, 8), (256, 8, 2), (700, 8, 2), (300, 64, 8)])
def test_both_forms_equal_the_reference_with_gradients(tokens, n_experts, top_k):
    x, _, weights, experts, fc1s, fc2s = problem(tokens, n_experts, top_k)
    want = reference(x, weights, experts, fc1s, fc2s)
    leaves = [x, weights, fc1s[0], fc2s[n_experts - 1]]
    grads = []
    for form in ("dense", "sorted"):
        ins = [t.clone().requires_grad_() for t in leaves]
        f1, f2 = {**fc1s, 0: ins[2]}, {**fc2s, n_experts - 1: ins[3]}
        got = (experts_dense(ins[0], ins[1], experts, f1, f2) if form == "dense" else
               experts_sorted(ins[0], ins[1], experts, f1, f2, n_experts))
        assert (got - want).abs().max() <= TOL, form
        (got * torch.linspace(-1, 1, got.numel()).reshape(got.shape)).sum().backward()
        # an expert no token chose: no gradient in the sorted form, zeros in the dense
        grads.append([torch.zeros_like(t) if t.grad is None else t.grad for t in ins])
    for a, b in zip(*grads):        # sums over up to 700 tokens: relative to their size
        assert (a - b).abs().max() <= TOL * max(1.0, float(a.abs().max()))


@pytest.mark.pure
def test_the_sorted_form_equals_the_reference_exactly_on_cpu():
    """Same rows per expert in the same order, summed into each token in expert order."""
    x, _, weights, experts, fc1s, fc2s = problem(500)
    assert torch.equal(experts_sorted(x, weights, experts, fc1s, fc2s, 8),
                       reference(x, weights, experts, fc1s, fc2s))


@pytest.mark.pure
def test_a_decode_step_reads_nothing_on_the_host():
    x, router, _, _, fc1s, fc2s = problem(64, 64, 8)
    want = moe_forward(x, router, fc1s, fc2s, 8, True, dense=False)
    with host_reads_raise():
        got = moe_forward(x, router, fc1s, fc2s, 8, True)          # 64 tokens: dense
        with pytest.raises(RuntimeError, match="host read"):        # the guard bites
            moe_forward(x, router, fc1s, fc2s, 8, True, dense=False)
        with pytest.raises(RuntimeError, match="host read"):
            reference(x, *route(x, router, 8, True), fc1s, fc2s)
    assert (got - want).abs().max() <= TOL


@pytest.mark.pure
def test_a_decode_steps_layer_traces_as_one_graph():
    """torch.compile with fullgraph=True refuses a graph break (a value read on the host
    to shape the computation); the dense form has none, the sorted one has."""
    import torch._dynamo

    x, router, _, _, fc1s, fc2s = problem(16)
    torch._dynamo.reset()
    traced = torch.compile(lambda t: moe_forward(t, router, fc1s, fc2s, 2, True),
                           fullgraph=True, backend="eager")
    assert (traced(x) - moe_forward(x, router, fc1s, fc2s, 2, True)).abs().max() <= TOL
    torch._dynamo.reset()
    broken = torch.compile(lambda t: moe_forward(t, router, fc1s, fc2s, 2, True, dense=False),
                           fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError):     # dynamo's data-dependent guard or graph break
        broken(x)
    torch._dynamo.reset()


# ---- cases, run on every rank of the gloo world ----------------------------------------

def case_forms_agree(ctx, path, tp):
    """On each sparse layer of a TP replica (experts split over TP, summed once): the
    largest difference between the dense and the sorted form at a decode shape (8 tokens)
    and a prefill shape (300 tokens), and whether the two routed alike."""
    from cases_model import replica

    from realign.runtime.moe import MoeMLP, RouterRecord, tp_mappings

    shard = replica(ctx, path, "lm", tp, 1, 1)
    if shard is None:
        return None
    diff, same = 0.0, True
    g = torch.Generator().manual_seed(5)
    for tokens in (8, 300):
        y = torch.randn(tokens, shard.spec.hidden, generator=g)
        for m in shard.module.modules():
            if not isinstance(m, MoeMLP):
                continue
            copy, reduce = tp_mappings(m.tp_group)
            outs, chosen = [], []
            for dense in (True, False):
                rec = RouterRecord()
                with torch.no_grad():
                    outs.append(moe_forward(y, m.router.weight, m.fc1s(), m.fc2s(), m.top_k,
                                            m.norm_topk_prob, copy, reduce, rec,
                                            n_experts=m.n_experts, dense=dense))
                chosen.append(rec.experts[0])
            diff = max(diff, float((outs[0] - outs[1]).abs().max()))
            same = same and torch.equal(chosen[0], chosen[1])
    return diff, same


def case_moe_steps(ctx, path, n_steps):
    """A MoE decoder's eager and traced decode steps from the same prefill: (largest
    logit difference, captures made, whether one step compiles as one graph)."""
    import torch._dynamo
    from cases_model import replica

    from realign.runtime.engines.captured_step import capture_steps
    from realign.runtime.engines.decoder import StageDecoder

    shard = replica(ctx, path, "lm", 1, 1, 1)
    if shard is None:
        return None
    rows, plen = 3, 9
    tokens = torch.randint(3, shard.spec.vocab_size, (rows, plen),
                           generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([plen, 4, 7])
    diff = 0.0
    with torch.inference_mode():
        with torch.inference_mode(False):
            eager = StageDecoder(shard, plen + n_steps, cache_rows=rows)
            traced = capture_steps(StageDecoder(shard, plen + n_steps, cache_rows=rows), "trace")
            whole = StageDecoder(shard, plen + n_steps, cache_rows=rows)
        x = eager.prefill(tokens, lengths).argmax(-1, keepdim=True)
        traced.prefill(tokens, lengths)
        whole.prefill(tokens, lengths)
        pos = lengths.clone()
        torch._dynamo.reset()
        one_graph = torch.compile(whole.eager_step, fullgraph=True, backend="eager")
        for t in range(n_steps - 1):
            kv = plen + t + 1
            a, b = eager.step(x, pos, kv), traced.step(x, pos, kv)
            if t == 0:
                from realign.runtime.engines.captured_step import span_bucket
                c = one_graph(x, pos.clone(), span_bucket(kv, whole.cache_keys), None)
                diff = max(diff, float((a - c).abs().max()))
            diff = max(diff, float((a - b).abs().max()))
            x = a.argmax(-1, keepdim=True)
            pos += 1
        torch._dynamo.reset()
    assert traced.replay is not None
    return diff, len(traced.replay.captures)


# ---- the tests -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from realign.assets.tiny import TINY_QWEN3_MOE, make_model

    root = tmp_path_factory.mktemp("moe_experts")
    return str(make_model(root / "moe", "qwen3_moe", seed=11,
                          arch=dict(TINY_QWEN3_MOE, initializer_range=0.3)))


@pytest.mark.cpu_dist
@pytest.mark.parametrize("tp", [1, 2])
def test_both_forms_agree_on_tp_replicas(world2, moe_path, tp):
    got = [r for r in world2.run("test_moe_experts:case_forms_agree", moe_path, tp)
           if r is not None]
    assert len(got) == tp
    for diff, same in got:
        assert diff <= TOL and same


@pytest.mark.cpu_dist
def test_moe_decode_steps_trace_as_one_graph_and_equal_eager_steps(world2, moe_path):
    got = [r for r in world2.run("test_moe_experts:case_moe_steps", moe_path, 7)
           if r is not None]
    assert len(got) == 1
    diff, captures = got[0]
    assert diff <= TOL and captures == 1         # 6 steps, all within 16 keys
