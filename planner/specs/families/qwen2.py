"""Qwen2 and Qwen2.5 (``model_type: qwen2``): LLaMA's decoder with a bias on the query,
key and value projections; small checkpoints tie the embeddings. Its sliding window
(``use_sliding_window``) is off in the released checkpoints."""
from planner.specs.families.base import DecoderFamily

FAMILY = DecoderFamily(model_type="qwen2", causal_lm="Qwen2ForCausalLM",
                       classifier="Qwen2ForSequenceClassification", qkv_bias=True)
