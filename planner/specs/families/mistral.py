"""Mistral (``model_type: mistral``): LLaMA's decoder; its ``sliding_window`` applies on
every layer unless switched off, and realign caps the sequence at the window (within
it, windowed attention is the full causal attention realign computes)."""
from planner.specs.families.base import DecoderFamily

FAMILY = DecoderFamily(model_type="mistral", causal_lm="MistralForCausalLM",
                       classifier="MistralForSequenceClassification",
                       window_by_default=True)
