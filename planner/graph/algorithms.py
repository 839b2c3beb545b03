"""The torch-free half of every algorithm: the data it trains on, the model roles it
needs and the dataflow graph of one iteration, built from the batch shape. The other
half (hyper-parameters, the ``prepare`` step, the losses) is
``realign/algorithms/<name>.py``, linked to this one by name
(``realign.algorithms.registry``), so the planner reads its part without torch.

PPO / GRPO / ReMax / REINFORCE++ / RLOO / GSPO / Dr. GRPO generate with the actor and
score with the reference and the reward; DPO scores preference pairs with the
reference; SFT and reward modelling are a single training call. Three graphs train on
a selection of what they generate, chosen inside the train call from the scores:
rejection sampling (the best of ``samples_per_prompt`` per prompt: the train call
trains one sequence per prompt), online DPO (the best and the worst: two) and DAPO
(its dynamic sampling generates ``prompts_generated`` prompts' groups to train
``prompts_per_step`` of them: the generate and scoring calls price the
over-generation, the train call the batch it trains). The reward is a model call when a
``reward`` model is configured, else a rule function on the generated text
(:class:`~planner.graph.dataflow.RuleReward`, part of the graph). The reference is optional for
the RL algorithms: without a ``ref`` model the graph has no reference call, which is
right only when the KL coefficient is 0 (realign's run checks that against the
hyper-parameters).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Literal, Mapping

from planner.errors import PlanError

# re-exported: the graph's callers build it from these shapes
from planner.graph.batch_shape import MAX_DROPPED_GROUP_FRAC as MAX_DROPPED_GROUP_FRAC
from planner.graph.batch_shape import BatchShape as BatchShape
from planner.graph.batch_shape import EvalShape as EvalShape
from planner.graph.batch_shape import prompts_generated as prompts_generated
from planner.graph.dataflow import MFC, DataflowGraph, Evaluation, RuleReward
from planner.graph.lengths import GenLengths
from planner.graph.proximal import with_proximal
from planner.graph.sampling_rounds import DEFAULT_ROUND_CAP_FACTOR, sized_rounds
from planner.graph.turns import Turns

Algorithm = Literal["ppo", "grpo", "remax", "reinforce_pp", "rloo", "dpo", "sft", "rm",
                    "rejection_sampling", "online_dpo", "dapo", "gspo", "dr_grpo"]
DataKind = Literal["prompts", "preferences", "sft"]

#: The graph key each kind of dataset fills (the graph's one dataset key).
DATASET_KEYS: Mapping[str, str] = MappingProxyType(
    {"prompts": "prompts", "preferences": "pairs", "sft": "examples"})

def _evaluation(shape: BatchShape, ev: EvalShape, trained_output: str) -> list[MFC]:
    """A greedy and a sampled generation on the held-out prompts, after training (they
    read the trained policy: its training call's output), every ``ev.every`` steps."""
    p, g = shape.prompt_len, shape.gen_len
    common = dict(role="actor", kind="generate", prompt_len=p, gen_len=g, every=ev.every,
                  purpose="eval", input_keys=("eval_prompts", trained_output))
    return [MFC(name="actor.eval_greedy", n_seqs=ev.n_prompts, greedy=True,
                output_keys=("eval_greedy_seqs",), **common),
            MFC(name="actor.eval_sample", n_seqs=ev.n_prompts * ev.samples,
                output_keys=("eval_sample_seqs",), **common)]


EVALUATIONS = (Evaluation(seqs_key="eval_greedy_seqs", name="greedy"),
               Evaluation(seqs_key="eval_sample_seqs", name="sample"))


def _rollout(shape: BatchShape, n: int, with_reward_model: bool, with_ref: bool
             ) -> tuple[list[MFC], list[RuleReward]]:
    """actor.generate, then the reward (a model call, or a rule on the text) and the
    reference (if one) scoring."""
    p, g = shape.prompt_len, shape.gen_len
    calls = [MFC(name="actor.generate", role="actor", kind="generate", n_seqs=n,
                 prompt_len=p, gen_len=g, input_keys=("prompts",),
                 output_keys=("seqs", "logprobs"))]
    rules = []
    if with_reward_model:
        calls.append(MFC(name="reward.inference", role="reward", kind="inference", n_seqs=n,
                         prompt_len=p, gen_len=g, input_keys=("seqs",), output_keys=("rewards",)))
    else:
        rules.append(RuleReward(seqs_key="seqs", out_key="rewards"))
    if with_ref:
        calls.append(MFC(name="ref.inference", role="ref", kind="inference", n_seqs=n,
                         prompt_len=p, gen_len=g, input_keys=("seqs",),
                         output_keys=("ref_logprobs",)))
    return calls, rules


def _actor_train(shape: BatchShape, n: int, inputs: tuple[str, ...], group_size: int = 1) -> MFC:
    return MFC(name="actor.train", role="actor", kind="train", n_seqs=n,
               prompt_len=shape.prompt_len, gen_len=shape.gen_len, input_keys=inputs,
               output_keys=("actor_stats",), n_minibatches=shape.ppo_minibatches,
               n_epochs=shape.ppo_epochs, group_size=group_size)


Built = tuple[list[MFC], list[RuleReward]]


def ppo(shape: BatchShape, with_reward_model: bool, with_ref: bool) -> Built:
    n = shape.prompts_per_step * shape.samples_per_prompt
    p, g = shape.prompt_len, shape.gen_len
    calls, rules = _rollout(shape, n, with_reward_model, with_ref)
    calls.append(MFC(name="critic.inference", role="critic", kind="inference", n_seqs=n,
                     prompt_len=p, gen_len=g, input_keys=("seqs",), output_keys=("values",)))
    ins = ("seqs", "logprobs") + (("ref_logprobs",) if with_ref else ()) + ("values", "rewards")
    calls.append(_actor_train(shape, n, ins))
    calls.append(MFC(name="critic.train", role="critic", kind="train", n_seqs=n, prompt_len=p,
                     gen_len=g, input_keys=ins, output_keys=("critic_stats",),
                     n_minibatches=shape.ppo_minibatches, n_epochs=shape.ppo_epochs))
    return calls, rules


def critic_free(shape: BatchShape, with_reward_model: bool, with_ref: bool) -> Built:
    """GRPO, REINFORCE++, RLOO, GSPO and Dr. GRPO share one graph; they differ in the
    advantage and the loss."""
    n = shape.prompts_per_step * shape.samples_per_prompt
    calls, rules = _rollout(shape, n, with_reward_model, with_ref)
    ins = ("seqs", "logprobs") + (("ref_logprobs",) if with_ref else ()) + ("rewards",)
    return calls + [_actor_train(shape, n, ins)], rules


def remax(shape: BatchShape, with_reward_model: bool, with_ref: bool) -> Built:
    """ReMax: a sampled and a greedy rollout; the greedy reward is the baseline."""
    n = shape.prompts_per_step * shape.samples_per_prompt
    p, g = shape.prompt_len, shape.gen_len
    calls, rules = _rollout(shape, n, with_reward_model, with_ref)
    calls.insert(1, MFC(name="actor.greedy_generate", role="actor", kind="generate",
                        n_seqs=shape.prompts_per_step, prompt_len=p, gen_len=g,
                        input_keys=("prompts",), output_keys=("greedy_seqs",), greedy=True))
    if with_reward_model:
        calls.insert(3, MFC(name="reward.greedy_inference", role="reward", kind="inference",
                            n_seqs=shape.prompts_per_step, prompt_len=p, gen_len=g,
                            input_keys=("greedy_seqs",), output_keys=("greedy_rewards",)))
    else:
        rules.append(RuleReward(seqs_key="greedy_seqs", out_key="greedy_rewards"))
    ins = (("seqs", "logprobs") + (("ref_logprobs",) if with_ref else ())
           + ("rewards", "greedy_rewards"))
    return calls + [_actor_train(shape, n, ins)], rules


def dpo(shape: BatchShape, with_reward_model: bool, with_ref: bool) -> Built:
    """DPO: the reference scores chosen and rejected responses, the actor trains."""
    n = 2 * shape.prompts_per_step
    p, g = shape.prompt_len, shape.gen_len
    return [
        MFC(name="ref.inference", role="ref", kind="inference", n_seqs=n, prompt_len=p,
            gen_len=g, input_keys=("pairs",), output_keys=("ref_logprobs",)),
        _actor_train(shape, n, ("pairs", "ref_logprobs"), group_size=2),   # whole pairs
    ], []


def sft(shape: BatchShape, with_reward_model: bool, with_ref: bool) -> Built:
    return [_actor_train(shape, shape.prompts_per_step, ("examples",))], []


def rm(shape: BatchShape, with_reward_model: bool, with_ref: bool) -> Built:
    """Reward modelling: pairwise Bradley-Terry on chosen/rejected responses."""
    return [MFC(name="reward.train", role="reward", kind="train",
                n_seqs=2 * shape.prompts_per_step, prompt_len=shape.prompt_len,
                gen_len=shape.gen_len, input_keys=("pairs",), output_keys=("reward_stats",),
                n_minibatches=shape.ppo_minibatches, n_epochs=shape.ppo_epochs,
                group_size=2)], []


def rejection_sampling(shape: BatchShape, with_reward_model: bool, with_ref: bool) -> Built:
    """Best-of-N fine-tuning (RAFT): ``samples_per_prompt`` responses per prompt are
    scored; the train call keeps each prompt's best and trains SFT on it, so it trains
    one sequence per prompt (never the N it was given)."""
    n = shape.prompts_per_step * shape.samples_per_prompt
    calls, rules = _rollout(shape, n, with_reward_model, False)
    return calls + [_actor_train(shape, shape.prompts_per_step, ("seqs", "rewards"))], rules


def online_dpo(shape: BatchShape, with_reward_model: bool, with_ref: bool) -> Built:
    """Online DPO: ``samples_per_prompt`` responses per prompt, scored by the reward
    (model or rule) and by the reference; the train call pairs each prompt's best with
    its worst, so it trains two sequences per prompt (whole pairs per micro-batch)."""
    n = shape.prompts_per_step * shape.samples_per_prompt
    calls, rules = _rollout(shape, n, with_reward_model, with_ref)
    train = _actor_train(shape, 2 * shape.prompts_per_step, ("seqs", "ref_logprobs", "rewards"),
                         group_size=2)
    return calls + [train], rules


def dapo(shape: BatchShape, with_reward_model: bool, with_ref: bool) -> Built:
    """DAPO: GRPO's graph with dynamic sampling priced. The rollout and its scoring run
    on ``prompts_generated`` prompts' groups, the train call on the
    ``prompts_per_step`` groups it keeps (over-generation from the expected share of
    constant groups, :attr:`BatchShape.dropped_group_frac`)."""
    g = shape.samples_per_prompt
    calls, rules = _rollout(shape, shape.prompts_generated * g, with_reward_model, with_ref)
    ins = ("seqs", "logprobs") + (("ref_logprobs",) if with_ref else ()) + ("rewards",)
    return calls + [_actor_train(shape, shape.prompts_per_step * g, ins)], rules


@dataclass(frozen=True)
class AlgorithmSpec:
    """What the planner (and the run's checks) know of one algorithm."""

    name: str
    data_kind: DataKind                      #: what each line of its training data holds
    required_roles: tuple[str, ...]          #: model roles it cannot do without
    optional_roles: tuple[str, ...]          #: roles it uses when configured
    builder: Callable[[BatchShape, bool, bool], Built]   #: (shape, with RM, with ref)
    #: its loss corrects a rollout an older policy made (the decoupled PPO loss), so
    #: generation may run ahead of training (algorithm.max_staleness >= 1)
    runs_ahead: bool = True

    @property
    def dataset_key(self) -> str:
        """The graph key its dataset fills."""
        return DATASET_KEYS[self.data_kind]

    @property
    def generates(self) -> bool:
        """It samples responses to prompts and is rewarded for them (RL)."""
        return self.data_kind == "prompts"


def _table(*specs: AlgorithmSpec) -> Mapping[str, AlgorithmSpec]:
    table: dict[str, AlgorithmSpec] = {}
    for a in specs:
        if a.name in table:
            raise ValueError(f"algorithm {a.name!r} listed twice")
        table[a.name] = a
    return MappingProxyType(table)


_RL_OPTIONAL = ("ref", "reward")

#: Every algorithm by name (the names of ``realign.algorithms.registry.ALGORITHMS``).
ALGORITHMS: Mapping[str, AlgorithmSpec] = _table(
    AlgorithmSpec("ppo", "prompts", ("actor", "critic", "reward"), ("ref",), ppo),
    AlgorithmSpec("grpo", "prompts", ("actor",), _RL_OPTIONAL, critic_free),
    AlgorithmSpec("remax", "prompts", ("actor",), _RL_OPTIONAL, remax),
    AlgorithmSpec("reinforce_pp", "prompts", ("actor",), _RL_OPTIONAL, critic_free),
    AlgorithmSpec("rloo", "prompts", ("actor",), _RL_OPTIONAL, critic_free),
    AlgorithmSpec("dpo", "preferences", ("actor", "ref"), (), dpo),
    AlgorithmSpec("sft", "sft", ("actor",), (), sft),
    AlgorithmSpec("rm", "preferences", ("reward",), (), rm),
    AlgorithmSpec("rejection_sampling", "prompts", ("actor",), ("reward",), rejection_sampling,
                  runs_ahead=False),
    AlgorithmSpec("online_dpo", "prompts", ("actor", "ref"), ("reward",), online_dpo,
                  runs_ahead=False),
    AlgorithmSpec("dapo", "prompts", ("actor",), _RL_OPTIONAL, dapo),
    AlgorithmSpec("gspo", "prompts", ("actor",), _RL_OPTIONAL, critic_free),
    AlgorithmSpec("dr_grpo", "prompts", ("actor",), _RL_OPTIONAL, critic_free),
)


def algorithm_spec(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise PlanError(f"unknown algorithm {name!r}; allowed: {', '.join(ALGORITHMS)}",
                        field="algorithm.name")
    return ALGORITHMS[name]


def build_graph(algorithm: str, shape: BatchShape, roles: set[str],
                train_micro_batches: int | None = None,
                evaluation: EvalShape | None = None,
                lengths: GenLengths | None = None, max_staleness: int = 0,
                asynchronous: bool = False,
                prompt_lengths: GenLengths | None = None,
                score_rollout: bool = False, turns: Turns | None = None,
                max_sampling_rounds: int = 1, max_round_prompts: int = 0,
                sampling_drop_frac: float | None = None) -> DataflowGraph:
    """The dataflow graph of ``algorithm`` for the configured model ``roles``.
    ``train_micro_batches``: every train call runs with exactly this many micro-batches
    (``train.micro_batches``); None lets the planner choose. ``evaluation``: the actor
    generates on held-out prompts after training, every ``evaluation.every`` steps.
    ``lengths``: the response-length distribution of every generate call (a recorded
    one); default: from ``shape.gen_len_mean``, or none (every response runs to
    ``gen_len``). ``prompt_lengths``: the distribution of the training prompts'
    lengths (``prompt_len`` is its cap); None: every prompt is ``prompt_len`` long.
    ``max_staleness``: the staleness bound the run enforces;
    ``score_rollout``: the actor's training forward scores the rollout before its update
    (``actor.prox_inference``) in a synchronous graph too: the log-probs its train call
    compares with the rollout's (vLLM's may differ) and truncated importance sampling
    corrects with. ``asynchronous`` (needs a bound of at least 1): rollout generation runs one step
    ahead of training, and the actor's current policy scores the rollout before it
    trains (:func:`planner.graph.proximal.with_proximal`). ``turns``: every generate call (rollout and
    evaluations) is multi-turn episodes of this shape (:mod:`planner.graph.turns`).
    ``max_sampling_rounds`` (DAPO): the step generates and scores again until its batch
    is full, at most this many rounds, a later one for at most ``max_round_prompts``
    prompts (0: the default cap), priced at the prompts expected at the drop rate
    ``sampling_drop_frac`` (a recorded run's; None: ``shape.dropped_group_frac``)
    (:func:`_sampling_rounds`)."""
    if asynchronous and max_staleness < 1:
        raise PlanError("asynchronous execution needs max_staleness >= 1",
                        field="algorithm.max_staleness")
    if shape.gen_len_mean is not None and shape.gen_len_mean > shape.gen_len:
        raise PlanError(f"gen_len_mean {shape.gen_len_mean} exceeds gen_len {shape.gen_len}",
                        field="algorithm.gen_len_mean")
    if lengths is None and shape.gen_len_mean is not None:
        lengths = GenLengths(max_len=shape.gen_len, mean=shape.gen_len_mean)
    if prompt_lengths is not None and prompt_lengths.max_len != shape.prompt_len:
        raise PlanError(f"the prompt lengths are capped at {prompt_lengths.max_len}, "
                        f"prompt_len is {shape.prompt_len}", field="algorithm.prompt_len")
    spec = algorithm_spec(algorithm)
    if shape.dropped_group_frac and algorithm != "dapo":
        raise PlanError(f"{algorithm} drops no groups, so it generates for no more prompts "
                        "than it trains; only dapo takes a dropped_group_frac",
                        field="algorithm.dropped_group_frac")
    if max_staleness >= 1 and spec.generates and not spec.runs_ahead:
        raise PlanError(f"{algorithm} trains on a selection of its rollout with no "
                        "correction for an older policy's samples; set "
                        "algorithm.max_staleness to 0", field="algorithm.max_staleness")
    missing = [r for r in spec.required_roles if r not in roles]
    if missing:
        raise PlanError(f"{algorithm} needs the model role(s) {', '.join(missing)}",
                        field="models")
    with_rm = "reward" in roles and spec.generates
    calls, rules = spec.builder(shape, with_rm, "ref" in roles)
    used = {m.role for m in calls}
    assert used <= set(spec.required_roles) | set(spec.optional_roles), used
    extra = sorted(roles - used)
    if extra:
        raise PlanError(f"{algorithm} does not use the model role(s) {', '.join(extra)}; "
                        f"remove them", field="models")
    if train_micro_batches is not None:
        calls = [m.model_copy(update={"micro_batches": train_micro_batches})
                 if m.kind == "train" else m for m in calls]
    evaluations: tuple[Evaluation, ...] = ()
    if evaluation is not None:
        actor_train = next((m for m in calls if m.kind == "train" and m.role == "actor"), None)
        if actor_train is None:
            raise PlanError(f"{algorithm} trains no actor, so there is no policy to "
                            "evaluate; remove the eval section", field="eval")
        calls += _evaluation(shape, evaluation, actor_train.output_keys[0])
        evaluations = EVALUATIONS
    if lengths is not None or prompt_lengths is not None:
        calls = _with_lengths(calls, lengths, prompt_lengths)
    if turns is not None:
        calls = [m.model_copy(update={"turns": turns}) if m.kind == "generate" else m
                 for m in calls]
    if asynchronous:
        if not spec.generates:
            raise PlanError(f"{algorithm} generates nothing, so it has nothing to run "
                            "ahead; set algorithm.max_staleness to 0", field="algorithm.max_staleness")
    if score_rollout and not (spec.generates and spec.runs_ahead):
        raise PlanError(f"{algorithm} takes no correction of its rollout's log-probs, so the "
                        "training forward does not score them", field="rollout.engine")
    if max_sampling_rounds > 1:
        calls = _sampling_rounds(calls, shape, algorithm, max_sampling_rounds, asynchronous,
                                 max_round_prompts, sampling_drop_frac)
    if asynchronous or score_rollout:
        calls = with_proximal(calls)
    return DataflowGraph(algorithm=algorithm, mfcs=tuple(calls), rule_rewards=tuple(rules),
                         evaluations=evaluations, max_staleness=max_staleness,
                         ahead_steps=1 if asynchronous else 0)


def _with_lengths(calls: list[MFC], lengths: GenLengths | None,
                  prompt_lengths: GenLengths | None) -> list[MFC]:
    """``lengths`` (responses) on every generate call, ``prompt_lengths`` on those
    that read the training prompts, and both of a generate call's on every call that
    scores or trains the sequences it generates (priced at the batch's padded
    length: :mod:`planner.graph.padding`)."""
    made: dict[str, dict[str, GenLengths | None]] = {}
    out = []
    for m in calls:
        if m.kind == "generate":
            update = {"lengths": lengths,
                      "prompt_lengths": prompt_lengths if m.input_keys[0] == "prompts" else None}
            made[m.output_keys[0]] = update
            out.append(m.model_copy(update=update))
        elif m.input_keys and m.input_keys[0] in made:
            out.append(m.model_copy(update=made[m.input_keys[0]]))
        else:
            out.append(m)
    return out


def _sampling_rounds(calls: list[MFC], shape: BatchShape, algorithm: str, max_rounds: int,
                     asynchronous: bool, cap: int, drop_frac: float | None) -> list[MFC]:
    """DAPO's dynamic sampling in rounds: the rollout's generate call and the calls that
    score its sequences run once per round, the first on the call's shape, a later one
    on as many prompts as the missing groups need at the drop rate
    (:func:`planner.graph.sampling_rounds.sized_rounds` at ``drop_frac``, else
    ``shape.dropped_group_frac``; at most ``cap`` prompts, 0: the default cap), so they
    are priced at the expected prompts over the first round's (passes of the call's
    shape; a larger round runs in more waves and micro-batches, memory at one); the train
    call, at the batch it trains, once. Later rounds are priced in multiples of one
    prompt: the runtime's multiple (:func:`realign.run.program.round_quantum`) follows
    from the data-parallel sizes the search chooses for this graph, so where it is q > 1
    a later round generates for up to q - 1 prompts more than priced."""
    field = "algorithm.params.max_sampling_rounds"
    if algorithm != "dapo":
        raise PlanError(f"{algorithm} drops no groups, so it samples once a step", field=field)
    if asynchronous:
        raise PlanError("a rollout generated one step ahead cannot be sampled again until "
                        "the batch is full; set max_sampling_rounds to 1 or "
                        "algorithm.max_staleness to 0", field=field)
    first = shape.prompts_generated
    f = drop_frac if drop_frac is not None else shape.dropped_group_frac or 0.0
    _, prompts, _ = sized_rounds(first, shape.prompts_per_step, f, max_rounds,
                                 cap or DEFAULT_ROUND_CAP_FACTOR * first)
    passes = max(1.0, prompts / first)
    rollout = next(m for m in calls if m.kind == "generate" and "seqs" in m.output_keys)
    return [m.model_copy(update={"sampling_rounds": passes})
            if m is rollout or (m.kind == "inference" and rollout.output_keys[0] in m.input_keys)
            else m for m in calls]
