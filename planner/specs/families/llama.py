"""LLaMA 2, 3, 3.1-3.3 (``model_type: llama``): the decoder every family here builds on.
LLaMA 3.1+ extends its context with ``rope_type: llama3`` (factor, low/high frequency
factors, original window), which realign computes as transformers does."""
from planner.specs.families.base import DecoderFamily

FAMILY = DecoderFamily(model_type="llama", causal_lm="LlamaForCausalLM",
                       classifier="LlamaForSequenceClassification")
