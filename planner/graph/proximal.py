"""The proximal call of an asynchronous graph: the actor's current policy scores the
rollout an older policy generated, before the actor trains on it (the decoupled PPO
loss's proximal policy; also the rollout's scoring in a synchronous graph whose
training forward corrects its log-probs)."""
from __future__ import annotations

from planner.graph.dataflow import MFC

#: The call that scores an asynchronous rollout with the actor's current policy.
PROXIMAL_MFC = "actor.prox_inference"


def with_proximal(calls: list[MFC]) -> list[MFC]:
    """An asynchronous graph: before the actor trains, its current policy (the
    proximal policy of the decoupled PPO loss) scores the rollout that an older policy
    generated (``prox_logprobs``), and the actor's train call reads them. It scores
    every sequence generated: the train call selects its rows after (DAPO's dynamic
    sampling trains fewer than were generated)."""
    i = next(i for i, m in enumerate(calls) if m.kind == "train" and m.role == "actor")
    t = calls[i]
    rollout = next(m for m in calls if m.kind == "generate" and "seqs" in m.output_keys)
    prox = MFC(name=PROXIMAL_MFC, role="actor", kind="inference", n_seqs=rollout.n_seqs,
               prompt_len=t.prompt_len, gen_len=t.gen_len, input_keys=("seqs",),
               output_keys=("prox_logprobs",), lengths=t.lengths,
               prompt_lengths=t.prompt_lengths)
    trained = t.model_copy(update={"input_keys": t.input_keys + ("prox_logprobs",)})
    return calls[:i] + [prox, trained] + calls[i + 1:]
