"""Settings of the analytic cost model (every default documented, units in names)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Generation's KV cache holds whole blocks of this many positions (realign's decoder
#: attends over whole 16-key blocks, see ``realign/runtime/engines/decoder.py``;
#: vLLM's paged cache also defaults to 16-token blocks).
KV_CACHE_BLOCK_TOKENS = 16


class CostModelConfig(BaseModel):
    """Efficiencies and training precision the analytic cost model assumes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    matmul_efficiency: float = Field(
        0.5, gt=0, le=1, description="Fraction of peak FLOP/s that large GEMMs reach.")
    gemm_half_rows: float = Field(
        128.0, ge=0, description="GEMM rows (tokens of one micro-batch) at which a layer's "
        "GEMMs reach half of matmul_efficiency; 0 ignores the row count.")
    gemm_half_width: float = Field(
        128.0, ge=0, description="Mean TP-sharded GEMM width (columns per GPU) at which a "
        "layer's GEMMs reach half of matmul_efficiency; 0 ignores the width.")
    mem_bw_efficiency: float = Field(
        0.8, gt=0, le=1, description="Fraction of peak memory bandwidth that streaming reads reach.")
    link_efficiency: float = Field(
        0.8, gt=0, le=1, description="Fraction of link bandwidth that collectives and copies reach.")
    param_dtype_bytes: int = Field(2, gt=0, description="Bytes per weight in compute (bf16: 2).")
    grad_dtype_bytes: int = Field(4, gt=0, description="Bytes per main gradient (megatron keeps fp32: 4).")
    optimizer_state_bytes_per_param: int = Field(
        12, gt=0, description="fp32 master weight + Adam m + v: 12 bytes per parameter.")
    optimizer_step_bytes_per_param: int = Field(
        30, gt=0, description="Memory traffic of one Adam step per parameter (reads and writes).")
    distributed_optimizer: bool = Field(
        True, description="Shard optimizer state over the data-parallel ranks (ZeRO-1).")
    activation_recompute: bool = Field(
        False, description="Full activation recomputation in training (one extra forward).")
    mem_usable_fraction: float = Field(
        0.9, gt=0, le=1, description="Part of device memory a plan may use (rest: context, fragmentation).")
    kv_cache_block_tokens: int = Field(
        KV_CACHE_BLOCK_TOKENS, gt=0, description="Positions per KV-cache block: a generated "
        "sequence's cache is allocated for prompt_len + gen_len rounded up to whole blocks.")
    max_micro_batches: int = Field(
        64, gt=0, description="Largest micro-batch count the search considers.")
