"""What a compiled program says about a stream (``rollout.mode: streaming``), pure:
the rollout's generate call and the ranks that stream it, the reallocation that brings
the trained weights to them, the rule rewards scored on its samples, and the program of
every other op of a step, which the training side runs on each batch it takes.

ReMax's greedy baseline (``actor.greedy_generate``) is part of the stream: its
response to each prompt is decoded as one more sample of the group, greedily, in the
same slots (:class:`~realign.runtime.engines.stream_decode.StreamDecoder`'s
``greedy``), and streamed with the group (``greedy_seqs``, and its rule reward).

The training side's program is the step's ops without the rollout (its generate calls
and rule rewards, not made ahead nor in a prologue), without the reallocation into the
rollout's copy and its release (the weights move when the stream's schedule says), and
without the sends of what the generator streams (it sends each batch to every rank of
the training side itself). Every op left must lie on the training side's ranks. Its
calls scoring the rollout run on the batch the buffer keeps (:func:`kept_rows`: DAPO's
plan sizes them for its over-generated rows).

The stream's numbers (:class:`planner.graph.streaming.StreamSettings`) come from the
plan's ``streaming`` section; a plan without one (``plan.manual``) gets them from its
estimates (:func:`stream_settings`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.graph.streaming import StreamSettings
from planner.plan import ExecutionPlan
from realign.errors import UserError
from realign.run.ops import Call, Op, Realloc, Release, RuleReward, Send
from realign.run.program import Program


@dataclass(frozen=True)
class StreamParts:
    gen: Call                        #: the rollout's generate call (on the generator)
    realloc: Realloc                 #: trained copy -> the generator's copy
    rewards: tuple[RuleReward, ...]  #: rule rewards of its samples (scored by the generator)
    train: Program                   #: every other op of a step (the training side)
    train_ranks: tuple[int, ...]     #: every rank outside the generator, ascending
    greedy: Call | None = None       #: ReMax's greedy baseline call (streamed with gen)

    @property
    def gen_rank(self) -> int:
        return self.gen.ranks[0]

    @property
    def streamed_keys(self) -> tuple[str, ...]:
        """The records each batch carries, in the order they are sent: the prompts,
        the generate call's outputs, the rule rewards."""
        greedy = self.greedy.outputs if self.greedy is not None else ()
        return (self.gen.inputs[0], *self.gen.outputs, *greedy,
                *(r.out_key for r in self.rewards))


def _rollout(program: Program) -> tuple[Call, Call | None]:
    """(the sampled rollout call, the greedy baseline call or None)."""
    ops = [op for op in program.ops + program.prologue
           if isinstance(op, Call) and op.kind == "generate" and not op.mfc.is_eval]
    sampled = sorted({op.name for op in ops if not op.mfc.greedy})
    greedy = sorted({op.name for op in ops if op.mfc.greedy})
    if len(sampled) != 1 or len(greedy) > 1:
        raise UserError(f"rollout.mode: streaming streams one sampled generate call (and "
                        f"ReMax's greedy baseline); the plan's graph has "
                        f"{sampled + greedy or 'none'}; use rollout.mode: step",
                        field="rollout.mode")
    first = next(op for op in ops if op.name == sampled[0])
    return first, next((op for op in ops if op.mfc.greedy), None)


def stream_parts(program: Program) -> StreamParts:
    """The stream's parts of ``program`` (module docs); a placement the stream cannot
    run is a UserError naming ``plan.manual.<call>``."""
    gen, greedy = _rollout(program)
    where = f"plan.manual.{gen.name}"
    if len(gen.ranks) != 1:
        raise UserError(f"{gen.name} generates on {len(gen.ranks)} GPUs; rollout.mode: "
                        "streaming runs its generator on one GPU (tp 1, pp 1, dp 1)",
                        field=f"{where}.mesh")
    reallocs = [op for op in program.ops if isinstance(op, Realloc) and op.to_mfc == gen.name]
    if not reallocs:
        raise UserError(f"{gen.name} runs on the trained copy itself; rollout.mode: "
                        "streaming generates on GPUs of its own, disjoint from training's",
                        field=f"{where}.mesh")
    made = {*gen.outputs, *(greedy.outputs if greedy is not None else ())}
    names = {gen.name} | ({greedy.name} if greedy is not None else set())
    rewards = tuple({op.out_key: op for op in program.ops + program.prologue
                     if isinstance(op, RuleReward) and op.seqs_key in made}.values())
    streamed = {*made, gen.inputs[0], *(r.out_key for r in rewards)}
    gen_ranks = set(gen.ranks)
    replicas = {gen.replica} | ({greedy.replica} if greedy is not None else set())

    def kept(op: Op) -> bool:
        match op:
            case Call() if op.name in names:
                return False
            case RuleReward() if op.seqs_key in made:
                return False
            case Realloc() if op.to_mfc in names:
                return False
            case Release() if op.replica in replicas:
                return False
            case Send() if op.key in streamed:
                return False
        return True
    ops = tuple(op for op in program.ops if kept(op))
    # calls first: a reallocation or send on the generator's GPU serves one of them
    for op in sorted(ops, key=lambda op: not isinstance(op, Call)):
        if gen_ranks & set(op.ranks):
            name = (op.name if isinstance(op, Call) else op.to_mfc if isinstance(op, Realloc)
                    else type(op).__name__.lower())
            raise UserError(f"{name} runs on GPU {sorted(gen_ranks & set(op.ranks))[0]}, the "
                            f"generator's; rollout.mode: streaming keeps every call other "
                            f"than {gen.name} on the training side's GPUs",
                            field=f"plan.manual.{name}.mesh")
    train = replace(program, ops=kept_rows(program, gen, ops), head=0, prologue=())
    train_ranks = tuple(r for r in range(program.n_ranks) if r not in gen_ranks)
    return StreamParts(gen, reallocs[0], rewards, train, train_ranks, greedy)


def kept_call(op: Call, rows: int, dp: int) -> Call:
    """Scoring call ``op`` on the ``rows`` of the kept batch: the micro-batch count the
    streaming search prices it with (:func:`planner.search.stream_search.priced_on`:
    the plan's, at most one a row of a data-parallel rank) where it splits the rank's
    rows, else the next count that does (the engines split the rows evenly:
    :func:`realign.runtime.engines.base.check_batch`); a packed call keeps its token
    budget (its bins bound its memory). ``rows`` splits over ``dp``.

    Example: the plan's 48 rows in 8 micro-batches at dp 2, 24 kept (12 a rank): 8
    does not split 12 -> 12; in 4 -> 4."""
    mfc = op.mfc.model_copy(update={"n_seqs": rows})
    if op.token_budget is not None:
        return replace(op, mfc=mfc)
    per_rank = rows // dp
    priced = max(1, min(op.micro_batches, per_rank))
    mb = next(m for m in range(priced, per_rank + 1) if per_rank % m == 0)
    return replace(op, mfc=mfc, micro_batches=mb)


def kept_rows(program: Program, gen: Call, ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """``ops`` with every step call scoring the rollout (the reference, the reward
    model, the actor's proximal forward) on the rows the actor trains
    (:func:`kept_call`): DAPO's plan sizes them for its over-generated rows, a stream
    drops the constant groups at the buffer and sends the training side the kept
    batch. ``ops`` themselves where the rows are the rollout's. A call whose
    data-parallel ranks cannot split the kept rows is a UserError naming its layout."""
    trained = next((op.mfc.n_seqs for op in ops if isinstance(op, Call)
                    and op.kind == "train" and op.role == "actor"), gen.mfc.n_seqs)
    if trained == gen.mfc.n_seqs:
        return ops
    dps = {r.key: r.dp for r in program.replicas}
    key = gen.outputs[0]
    out: list[Op] = []
    for op in ops:
        if (isinstance(op, Call) and op.kind == "inference" and not op.mfc.is_eval
                and key in op.inputs):
            dp = dps[op.replica]
            if trained % dp:
                raise UserError(f"{op.name} scores the stream's batch of {trained} rows "
                                f"(the groups a step trains) on {dp} data-parallel ranks, "
                                f"which do not split them; rollout.mode: streaming needs a "
                                f"data-parallel size that divides {trained}",
                                field=f"plan.manual.{op.name}.layout")
            op = kept_call(op, trained, dp)
        out.append(op)
    return tuple(out)


#: a training step's length on the generator's clock when the plan prices neither side
#: (decode iterations)
DEFAULT_TRAIN_ITERS = 8


def stream_settings(plan: ExecutionPlan, parts: StreamParts, group_size: int,
                    batch_groups: int, max_staleness: int, on_update: str) -> StreamSettings:
    """The stream's numbers: the plan's ``streaming`` section where it has one; else
    (a ``plan.manual``) ``slots`` the rows of one of the rollout call's waves, and the
    training step and the weights' copy in decode iterations of the plan's estimates:
    one iteration is the rollout call's estimate over its ``gen_len`` iterations per
    wave, the training step the estimates of the training side's calls
    (:data:`DEFAULT_TRAIN_ITERS` where they are 0), the copy its reallocation's."""
    if plan.streaming is not None:
        return plan.streaming.settings()
    gen = parts.gen
    slots = max(1, gen.mfc.n_seqs // max(1, gen.micro_batches))
    iter_s = gen.estimate_s / max(1, gen.mfc.gen_len * gen.micro_batches)
    train_s = sum(op.estimate_s for op in parts.train.ops if isinstance(op, Call)
                  and op.every == 1)
    if iter_s > 0 and train_s > 0:
        train_iters = max(1, math.ceil(train_s / iter_s))
        update_iters = math.ceil(parts.realloc.estimate_s / iter_s)
    else:
        train_iters, update_iters = DEFAULT_TRAIN_ITERS, 0
    assert on_update in ("continue", "finish"), on_update
    return StreamSettings(group_size=group_size, batch_groups=batch_groups, slots=slots,
                          train_iters=train_iters, update_iters=update_iters,
                          max_staleness=max_staleness,
                          on_update="finish" if on_update == "finish" else "continue")
