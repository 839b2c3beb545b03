"""What a plan of ``rollout.mode: streaming`` says about its stream: the split of the
cluster between a generator that decodes continuously and a trainer, the numbers of the
schedule both run (:class:`planner.graph.streaming.StreamSettings`, on the generator's
clock of decode iterations) and what the planner's steady-state simulation of that
schedule predicts.

The generation side is GPUs ``0 .. gen_gpus - 1`` (the rollout calls' meshes lie there),
the training side the ``train_gpus`` GPUs after it (the training calls and the scoring
of a step's batch), the same split the one-step-ahead mode uses
(:func:`planner.search.problem.async_splits`). The runtime reads the settings as they
are (:meth:`StreamingPlan.settings`): the same numbers give the same schedule.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from planner.graph.streaming import OnUpdate, StreamSettings


class StreamingPlan(BaseModel):
    """A streaming plan's schedule and its predicted steady state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gen_gpus: int = Field(gt=0, description="GPUs of the generation side: 0 .. gen_gpus - 1.")
    train_gpus: int = Field(gt=0, description="GPUs of the training side: the ones after "
                            "the generation side's.")
    group_size: int = Field(gt=0, description="Samples per prompt (a group enters the "
                            "buffer when all of them have ended).")
    batch_groups: int = Field(gt=0, description="Groups one training step takes.")
    slots: int = Field(gt=0, description="Samples the generation side decodes at once "
                       "(over all its replicas).")
    train_iters: int = Field(ge=0, description="One training step (its scoring calls, "
                             "training and optimizer step) in generator decode iterations.")
    update_iters: int = Field(ge=0, description="The generator's pause for new weights "
                              "(the priced reallocation) in decode iterations.")
    max_staleness: int = Field(ge=1, description="algorithm.max_staleness: a sample more "
                               "versions old than this is dropped, never trained.")
    on_update: OnUpdate = Field("continue", description="rollout.on_update: sequences in "
                                "flight continue under new weights, or finish under theirs.")
    capacity_groups: int = Field(gt=0, description="Groups the buffer and the generator's "
                                 "slots hold together (a generator that would overfill it "
                                 "waits).")
    iter_s: float = Field(gt=0, description="Seconds of one decode iteration of the "
                          "generation side with all its slots busy (the clock's unit).")
    step_s: float = Field(gt=0, description="Predicted seconds between two training steps "
                          "in the steady state.")
    samples_per_s: float = Field(gt=0, description="Predicted trained samples per second.")
    staleness_mean: float = Field(ge=0, description="Predicted mean staleness of a trained "
                                  "sample (versions between its oldest token's weights and "
                                  "the trainer's).")
    gen_idle_share: float = Field(ge=0, le=1, description="Predicted share of the time the "
                                  "generation side decodes nothing (a full buffer), the "
                                  "weights' copies not counted.")
    train_idle_share: float = Field(ge=0, le=1, description="Predicted share of the time "
                                    "the training side waits for a batch.")
    dropped_share: float = Field(ge=0, le=1, description="Predicted share of the finished "
                                 "groups dropped as too stale.")

    def settings(self) -> StreamSettings:
        """The schedule's numbers, for :class:`planner.graph.streaming.StreamSchedule`."""
        return StreamSettings(group_size=self.group_size, batch_groups=self.batch_groups,
                              slots=self.slots, train_iters=self.train_iters,
                              update_iters=self.update_iters,
                              max_staleness=self.max_staleness, on_update=self.on_update,
                              capacity_groups=self.capacity_groups)
