"""The dataset section of an experiment: where the JSONL file is, what kind of rows it
holds, which keys to read, and the length limits (in tokens)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from realign.paths import FilePath

DatasetKind = Literal["prompts", "preferences", "sft"]


class DatasetConfig(BaseModel):
    """One JSONL dataset (one JSON object per line).

    * ``prompts`` (PPO, GRPO, ...): ``{prompt_key: str | messages, answer_key: ...}``;
    * ``preferences`` (DPO, reward modelling): ``{prompt_key, chosen_key, rejected_key}``;
    * ``sft``: ``{prompt_key, response_key}``, or ``{messages_key: [...]}``: a
      conversation whose last message is the assistant's response; the loss covers every
      assistant turn of it and nothing else.

    A prompt is a string, or a list of ``{"role", "content"}`` messages rendered with
    the tokenizer's chat template (``chat_template_kwargs`` passed to it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: FilePath = Field(description="JSONL file; a relative path is resolved against the "
                                  "experiment YAML's folder.")
    kind: DatasetKind = Field(description="prompts | preferences | sft (what each line holds).")
    prompt_key: str = Field("prompt", description="Key of the prompt (a string or a list "
                                                  "of chat messages).")
    answer_key: str | None = Field(
        "answer", description="prompts: key of the reference answer a verifier reward "
                              "reads (string or number), required on every line; null for "
                              "prompt-only data (a reward model scores the responses).")
    chosen_key: str = Field("chosen", description="preferences: key of the preferred response.")
    rejected_key: str = Field("rejected", description="preferences: key of the other response.")
    response_key: str = Field("response", description="sft: key of the target response.")
    messages_key: str = Field(
        "messages", description="sft: key of a chat (list of {role, content}) used when a "
                                "line has no prompt_key; its last message is the response.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra variables of the tokenizer's chat "
        "template, e.g. {enable_thinking: false} for Qwen3's thinking switch.")
    max_prompt_len: int = Field(256, gt=0, description="Longest prompt in tokens (special "
                                "tokens included); a longer prompt is an error.")
    max_response_len: int = Field(
        256, gt=0, description="prompts: tokens generated per response; preferences/sft: "
                               "longest response in tokens (end token included), a longer "
                               "one is an error.")
    shuffle: bool = Field(True, description="Visit the rows in a seeded random order each epoch.")
    seed: int = Field(0, description="Seed of the visiting order.")

    @model_validator(mode="after")
    def _distinct_keys(self) -> "DatasetConfig":
        named: dict[str, list[str | None]] = {
            "prompts": [self.prompt_key, self.answer_key],
            "preferences": [self.prompt_key, self.chosen_key, self.rejected_key],
            "sft": [self.prompt_key, self.response_key, self.messages_key]}
        used = [k for k in named[self.kind] if k is not None]
        if len(set(used)) != len(used):
            raise ValueError(f"the keys of a {self.kind} dataset must differ, got {used}")
        return self
