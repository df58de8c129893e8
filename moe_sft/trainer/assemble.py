"""Model assembly steps: what the recipe turns on in a built model before DDP wraps it.

Each step reads the run's `Layout` (moe_sft/config/layout.py) for whether it can act, changes the
chunks, and returns the startup log lines saying what it did; a step that cannot act says so
instead of claiming an option that is inert (kernels.fused=false leaves megatron's own dispatch
and combine in place, which read none of the flags set here).
"""

from __future__ import annotations

from moe_sft.config.layout import Layout
from moe_sft.kernels import permute


def static_rows(chunks, layout: Layout, capacity: float) -> list[str]:
    """The allgather dispatchers' static row count (kernels/permute.py `enable_static_rows`); after
    the adapters, since experts with them are left out."""
    count = permute.enable_static_rows(chunks, layout.static_rows, capacity=capacity)
    return [f"{count} MoE layers permute a static row count per rank: no host wait in their dispatch"] if count else []


def combine_dtype(chunks, layout: Layout, dtype: str) -> list[str]:
    """model.moe_combine_dtype on the allgather dispatchers' combine (kernels/permute.py)."""
    if dtype == "fp32":
        return []
    if not layout.reduced_combine:
        if not layout.fused and layout.dispatcher == "allgather" and layout.expert_group > 1:
            return [f"model.moe_combine_dtype={dtype} is inactive: kernels.fused=false runs megatron's fp32 combine"]
        return []
    if permute.set_combine_dtype(chunks, dtype):
        return [f"the allgather's combine reduce-scatters in {dtype} (model.moe_combine_dtype; fp32 gives megatron's)"]
    return []
