"""RunSpec: a prepared run, everything the controller and its workers need, already
checked and resolved (``RUN/run_spec.json``).

Typed and whole: the experiment config and the execution plan are values inside it
(not JSON inside JSON), so the launchers, the job index and the controller read a
run folder through one :meth:`RunSpec.load` and never parse the file by hand. What
:func:`realign.run.prepare.prepare` decided is in it too (the reward function, the
verifier, the tokenizer's role, the held-out prompts; each call's purpose is its MFC's
in the plan's graph), and the algorithm's hyper-parameters are the config's, typed when
it was loaded: workers, controller, launchers and benchmarks read these and decide
nothing again.
"""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.errors import from_validation
from planner.graph.dataflow import DataflowGraph
from planner.plan import ExecutionPlan
from realign.algorithms.params import (
    AlgorithmParams,
    DAPOConfig,
    max_round_prompts,
    max_sampling_rounds,
)
from realign.config.experiment import ExperimentConfig
from realign.errors import UserError
from realign.run.ops import Op, estimate_s
from realign.run.program import Program, compile_program

#: The shortest default call timeout (torch's default collective timeout is 10 minutes).
MIN_CALL_TIMEOUT_S = 600.0
#: How many times the plan's estimate of a call it may take by default (estimates are
#: rough; a slow call must not kill the run).
CALL_TIMEOUT_SAFETY = 10.0
#: The default process-group timeout exceeds the longest call timeout by this much.
COLLECTIVE_MARGIN_S = 60.0


def final_role(graph: DataflowGraph) -> str:
    """The trained model a run of ``graph`` hands over at the end (``RUN/final/<role>``):
    the actor, or the reward model under reward modelling."""
    return "actor" if "actor" in graph.trainable_roles() else "reward"


class RunSpec(BaseModel):
    """A prepared run: the checked config, the plan it executes and where things are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    FILE: ClassVar[str] = "run_spec.json"

    config: ExperimentConfig = Field(description="The experiment, checked.")
    plan: ExecutionPlan = Field(description="The plan the run executes.")
    paths: dict[str, Path] = Field(description="Model role -> its HF checkpoint folder.")
    run_dir: Path = Field(description="The run folder.")
    # ---- resolved by prepare() ----
    tokenizer_role: str = Field(description="The model role whose folder holds the "
                                "tokenizer every process uses.")
    tokenizer_class: str | None = Field(None, description="The transformers class "
                                        "AutoTokenizer chose for that folder, which the "
                                        "workers build directly (realign.data.tokenizer."
                                        "load_tokenizer); None: AutoTokenizer chooses again.")
    reward_fn: str | None = Field(description="The reward function the rule rewards call "
                                  "(reward.fn or its default); None: no rule reward (a "
                                  "reward model scores, or nothing is generated).")
    verifier: str | None = Field(description="What counts as correct in evaluations "
                                 "(eval.verifier); None: no eval section.")
    eval_prompts: int | None = Field(description="How many held-out prompts each "
                                     "evaluation answers (the first of eval.data); None: "
                                     "no eval section.")

    # ---- derived -------------------------------------------------------------------
    @property
    def params(self) -> AlgorithmParams:
        """The algorithm's hyper-parameters, typed when the experiment was loaded
        (``algorithm.params`` with the batch shape's fields)."""
        return self.config.algorithm.params

    @property
    def steps(self) -> int:
        return self.config.run.steps

    @property
    def checkpoint_interval(self) -> int:
        return self.config.run.checkpoint_interval

    @property
    def n_workers(self) -> int:
        """One worker per device of the plan's cluster."""
        return self.plan.cluster.n_gpus

    @property
    def final_role(self) -> str:
        """The trained model the run hands over at the end (:func:`final_role`)."""
        return final_role(self.plan.graph)

    @property
    def final_dir(self) -> Path:
        return self.run_dir / "final" / self.final_role

    def program(self) -> Program:
        """The compiled program of the plan (what every worker executes each step), with
        DAPO's sampling rounds where ``algorithm.params.max_sampling_rounds`` > 1. A
        ``max_round_prompts`` below the rounds' quantum (the fewest prompts whose rows
        split over every round call's data-parallel ranks) is refused: no later round
        fits it (exit 2, when the run is prepared, before any worker starts)."""
        p = self.params
        group = (p.samples_per_prompt if isinstance(p, DAPOConfig)
                 and max_sampling_rounds(p) > 1 else None)
        program = compile_program(self.plan, round_group_size=group)
        quantum = program.round_quantum()
        if program.rounds is not None and max_round_prompts(p) < quantum:
            raise UserError(
                f"{max_round_prompts(p)}, fewer than the {quantum} prompts a later sampling "
                "round generates for at the least: a round's prompts are a multiple of "
                f"{quantum}, so that its rows ({program.rounds.group_size} samples a prompt) "
                "split evenly over every data-parallel rank of the rollout and the calls that "
                f"score it; set it to {quantum} or more (a multiple of {quantum}), or leave "
                "it out", field="algorithm.params.max_round_prompts")
        return program

    def call_timeout_s(self, op: Op) -> float:
        """How long op ``op`` of the program may run once all its ranks have reached it:
        ``run.call_timeout_s``, or :data:`CALL_TIMEOUT_SAFETY` times the plan's estimate of
        it (calls and reallocations), never below :data:`MIN_CALL_TIMEOUT_S`."""
        if self.config.run.call_timeout_s is not None:
            return self.config.run.call_timeout_s
        return max(MIN_CALL_TIMEOUT_S, CALL_TIMEOUT_SAFETY * estimate_s(op))

    def collective_timeout_s(self) -> float:
        """How long a worker waits in one collective before it fails by itself (the
        process groups' timeout): ``run.collective_timeout_s``, or long enough for the
        plan (:meth:`Program.collective_timeout_s`) and :data:`COLLECTIVE_MARGIN_S` more
        than the longest call timeout, so that the controller's named error
        (``run.call_timeout_s``) comes first."""
        if self.config.run.collective_timeout_s is not None:
            return self.config.run.collective_timeout_s
        program = self.program()
        longest = max((self.call_timeout_s(op) for op in (*program.ops, *program.prologue)),
                      default=0.0)
        return max(program.collective_timeout_s(), longest + COLLECTIVE_MARGIN_S)

    # ---- the file ------------------------------------------------------------------
    def save(self) -> Path:
        """Write ``RUN/run_spec.json`` atomically."""
        from realign.run.checkpoint import save_file

        p = self.run_dir / self.FILE
        save_file(self.model_dump_json(indent=1).encode(), p)
        return p

    @classmethod
    def load(cls, run_dir: str | Path) -> "RunSpec":
        """The prepared run of ``run_dir``; :class:`UserError` when there is none or it
        cannot be read."""
        p = Path(run_dir) / cls.FILE
        if not p.is_file():
            raise UserError(f"{run_dir} holds no prepared run ({cls.FILE} missing); "
                            "realign run or realign submit prepare one", field="run_dir")
        try:
            return cls.model_validate_json(p.read_bytes())
        except ValidationError as e:
            raise from_validation(e, cls, context=f"{p} is not a prepared run of this "
                                  "realign (prepare it again): ", field="run_dir") from None
        except UserError as e:        # the plan inside is inconsistent
            raise UserError(f"{p}: {e.message}; prepare it again", field="run_dir") from None
