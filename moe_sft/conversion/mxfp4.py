"""MXFP4 expert weights (gpt-oss's official release format).

A routed-expert parameter `X` (`model.layers.{L}.mlp.experts.gate_up_proj` / `down_proj`) is
stored as `X_blocks` (uint8 [E, rows, G, 16]: two e2m1 fp4 values per byte, low nibble first,
32 values per block) plus `X_scales` (uint8 [E, rows, G]: one e8m0 exponent per block, biased by
127). Dequantised, it is the parameter transformers' `GptOssExperts` holds: `rows` becomes the
last dim, [E, G * 32, rows] (gate_up_proj [E, hidden, 2 * intermediate], down_proj
[E, intermediate, hidden]), as `transformers.integrations.mxfp4.convert_moe_packed_tensors`
returns it. The streaming reader dequantises each tensor as it is read, like FP8 (fp8.py).
"""

from __future__ import annotations

import torch

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
STORED_DTYPE = "U8"  # safetensors dtype of both parts
VALUES_PER_BLOCK = 32
SCALE_BIAS = 127
# e2m1 codes 0..15: sign bit 3, then the 8 magnitudes (OCP MX spec; transformers' FP4_VALUES).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# fp32 elements of one dequantisation chunk (256 MiB). A whole gpt-oss-120b expert tensor in fp32
# is ~6 GiB (plus int64 lookup indices per nibble); chunking over the expert dim keeps the
# temporaries to a slice while the result is written straight into its final dtype.
_CHUNK_ELEMENTS = 64 << 20


def blocks_name(name: str) -> str:
    return name + BLOCKS_SUFFIX


def scales_name(name: str) -> str:
    return name + SCALES_SUFFIX


def base_name(stored: str) -> str | None:
    """`X` for a stored `X_blocks` / `X_scales`, else None."""
    for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX):
        if stored.endswith(suffix) and len(stored) > len(suffix):
            return stored[: -len(suffix)]
    return None


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] * 2 != VALUES_PER_BLOCK or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not MXFP4 "
            f"(expected blocks [..., rows, G, {VALUES_PER_BLOCK // 2}] and scales [..., rows, G])"
        )


def _dequantize_chunk(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [n, rows, G * 32] of blocks [n, rows, G, 16]; values are exact in fp32, so casting
    the result rounds once, as transformers' bf16 `ldexp(..., out=bf16)` does."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.empty(*blocks.shape[:-1], VALUES_PER_BLOCK, dtype=torch.float32)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]  # uint8 indices would be read as a mask
    values[..., 1::2] = lut[(blocks >> 4).long()]
    exponents = scales.to(torch.int32).sub_(SCALE_BIAS).unsqueeze(-1)
    return torch.ldexp(values, exponents).flatten(-2)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The parameter [..., G * 32, rows] of blocks [..., rows, G, 16] and scales [..., rows, G]:
    w = e2m1 * 2 ** (scale - 127), last two dims swapped (transformers' `convert_moe_packed_tensors`)."""
    _check(blocks, scales)
    *lead, rows, groups, _ = blocks.shape
    out = torch.empty(*lead, groups * VALUES_PER_BLOCK, rows, dtype=dtype)
    flat_blocks = blocks.reshape(-1, rows, groups, VALUES_PER_BLOCK // 2)
    flat_scales = scales.reshape(-1, rows, groups)
    flat_out = out.view(-1, groups * VALUES_PER_BLOCK, rows)
    step = max(1, _CHUNK_ELEMENTS // max(1, rows * groups * VALUES_PER_BLOCK))
    for start in range(0, flat_out.shape[0], step):
        chunk = _dequantize_chunk(flat_blocks[start : start + step], flat_scales[start : start + step])
        flat_out[start : start + step] = chunk.transpose(-1, -2)  # the copy casts to `dtype`
    return out


def _block_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Smallest e with amax <= 6 * 2**e (so no value saturates), within e8m0's [-127, 127]."""
    exp = torch.ceil(torch.log2(amax.clamp(min=2.0**-140) / 6.0))
    exp = torch.where(amax > 6.0 * torch.exp2(exp), exp + 1, exp)  # log2 rounding, either way
    exp = torch.where(amax <= 6.0 * torch.exp2(exp - 1), exp - 1, exp)
    return exp.clamp(-SCALE_BIAS, SCALE_BIAS)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `dequantize`, used by tests to build MXFP4 checkpoints: (blocks, scales) of a
    parameter [..., K, rows] (K a multiple of 32). Each block of 32 gets the smallest exponent that
    fits its largest magnitude and every value rounds to the nearest e2m1 value (ties to the
    smaller magnitude); values already e2m1 * 2**k within a block round-trip exactly."""
    if weight.dim() < 2 or weight.shape[-2] % VALUES_PER_BLOCK:
        raise ValueError(f"weight {tuple(weight.shape)}: dim -2 must be a multiple of {VALUES_PER_BLOCK}")
    *lead, k, rows = weight.shape
    x = weight.float().transpose(-1, -2).reshape(*lead, rows, k // VALUES_PER_BLOCK, VALUES_PER_BLOCK)
    exp = _block_exponents(x.abs().amax(-1))
    scaled = torch.ldexp(x.abs(), -exp.to(torch.int32).unsqueeze(-1))
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.unsqueeze(-1) - magnitudes).abs().argmin(-1).to(torch.uint8)
    codes = torch.where((x < 0) & (codes > 0), codes + 8, codes)  # sign bit; zero stays +0
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + SCALE_BIAS).to(torch.uint8)
