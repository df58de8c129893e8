"""FP8 block-quantised checkpoints (DeepSeek-V3's official release format).

A quantised linear weight is stored as `W.weight` (float8_e4m3fn) plus `W.weight_scale_inv`
(float32, one scale per 128×128 block; edge blocks are partial). The streaming reader
dequantises each weight as it is read — no separate cast step and no full copy in memory.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def dequantize_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """w[i, j] = fp8[i, j] * scale_inv[i // bm, j // bn] (DeepSeek-V3's `weight_dequant`)."""
    rows, cols = weight.shape
    bm, bn = block
    expected = (-(-rows // bm), -(-cols // bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)} "
            f"with {bm}x{bn} blocks (expected {expected})"
        )
    scales = scale_inv.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    return (weight.float() * scales).to(dtype)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """The inverse direction, used by tests to build FP8 checkpoints: (fp8 weight, scale_inv)."""
    rows, cols = weight.shape
    bm, bn = block
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale_inv = torch.empty(-(-rows // bm), -(-cols // bn))
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = weight[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].float()
            s = tile.abs().max().clamp(min=1e-12) / fp8_max
            scale_inv[i, j] = s
            out[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (tile / s).to(torch.float8_e4m3fn)
    return out, scale_inv
