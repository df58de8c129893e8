"""GPU kinds the planner knows, the kernels each has, and a throughput estimate (labelled as such).

Memory is what `torch.cuda.get_device_properties(0).total_memory` reports on the SXM parts
(the readings: docs/log.md), i.e. what the allocator can ever use.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from moe_sft.models.shape import default_peak_tflops, forward_flops


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16_dense_tflops: float  # vendor peak, dense (no sparsity)
    sm: str


GPUS = {
    "h100_80gb": GPU("H100-80GB SXM", 79.1, default_peak_tflops("H100"), "sm90"),
    "h200_141gb": GPU("H200-141GB SXM", 139.7, default_peak_tflops("H200"), "sm90"),
}

# Basis of the tokens/s estimate: model FLOPs at an assumed utilisation of the bf16 peak.
# 25% is a deliberately modest figure for an MoE on the torch-native spec (grouped_mm experts,
# varlen flash attention, all-to-all dispatch); not measured at these sizes (docs/planner.md).
ASSUMED_MFU = 0.25


def flash_attn_packages() -> tuple[bool, bool]:
    """(flash-attn 2, flash-attn-4) installed here, found without importing them (the planner runs
    without CUDA). flash-attn-4's wheel ships `flash_attn/cute/` and no `flash_attn/__init__.py`:
    installed alone it makes `flash_attn` a namespace package, which find_spec finds (origin None)
    though flash-attn 2's `flash_attn_varlen_func` is not there."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is None:
        return False, False
    fa2 = spec.origin is not None  # a regular package: flash-attn 2's __init__.py
    fa4 = any(os.path.isfile(os.path.join(p, "cute", "__init__.py")) for p in spec.submodule_search_locations or ())
    return fa2, fa4


def kernels(gpu: GPU, backend: str) -> list[str]:
    """What the target GPU offers and what this machine's Python environment will use."""
    fa2, fa4 = flash_attn_packages()
    lines = [
        f"{gpu.name} ({gpu.sm}): bf16 tensor cores, torch grouped_mm (sm90), flash varlen attention; FP8 "
        f"capable (moe-sft trains in bf16; FP8 source checkpoints are dequantised at conversion)"
    ]
    if backend == "te":
        lines.append("model.backend=te: Transformer Engine layer spec (needs transformer_engine on the cluster)")
    else:
        lines.append("model.backend=" + backend + ": torch-native spec (varlen attention, grouped_mm experts)")
    fallback = (
        "flash_attn.flash_attn_varlen_func" if fa2 else "torch's flash varlen kernel (flash-attn not installed here)"
    )
    if fa4 and gpu.sm in ("sm90", "sm100"):
        kernel = (
            "flash-attn-4 (flash_attn.cute.flash_attn_varlen_func) for the calls it supports with "
            f"model.attention_kernel=auto (the default) or fa4, else {fallback}"
        )
    else:
        kernel = fallback
    lines.append("attention kernel on CUDA: " + kernel)
    return lines


def flops_per_token(shape, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward) of documents of seq_len tokens:
    the telemetry's and benchmark's formula (models/shape.py), causal attention included."""
    return 3 * forward_flops(shape, [seq_len]) / seq_len


def estimate_tokens_per_s(shape, lay, gpu: GPU, seq_len: int, micro_batches: int, recompute) -> dict:
    """Global tokens/s = GPUs x MFU x peak / (FLOPs per token x recompute x pipeline bubble)."""
    fpt = flops_per_token(shape, seq_len)
    recompute_factor = 8 / 6 if recompute == "full" else 1.0  # one more forward
    bubble = 1 + (lay.pp - 1) / (lay.vp * max(micro_batches, 1)) if lay.pp > 1 else 1.0
    rate = lay.world * ASSUMED_MFU * gpu.bf16_dense_tflops * 1e12 / (fpt * recompute_factor * bubble)
    return dict(
        tokens_per_s=rate,
        per_gpu=rate / lay.world,
        flops_per_token=fpt,
        bubble=bubble,
        recompute_factor=recompute_factor,
    )
