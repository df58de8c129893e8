"""The frozen base of a LoRA run kept in FP8 on the GPU (`peft.fp8_base`): e4m3 values with one fp32
`scale_inv` per 128x128 block, the format DeepSeek-V3, Kimi-K2, GLM-4.5 and MiniMax-M2 release.

Every frozen weight of the decoder's Column/RowParallelLinear and of the grouped experts
(weight1/weight2, blocks per expert) is replaced by its FP8 values (the module's `weight`,
`weight1`, `weight2` become float8_e4m3fn parameters without gradient, same shapes) and a
non-persistent buffer `<name>_scale_inv`. Each GEMM dequantises its weight right before it and
drops it after: an autograd function saves the FP8 weight (never a bf16 copy) and dequantises it
again in the backward for the input gradient; a frozen weight has no weight gradient. Peak extra
memory: one layer's largest dequantised weight. Embeddings, the LM head, norms and routers stay as
they are.

How the modules are reached without touching megatron's classes:
- Column/RowParallelLinear: both forwards hand their weight to `self._forward_impl(input=...,
  weight=..., ...)`; an instance attribute `_forward_impl` runs the FP8 GEMM instead (the same
  arguments megatron's linear_with_frozen_weight takes, so TP/SP behave as megatron's frozen path).
- TorchGroupedMLP: an instance `forward` with the same steps as TorchGroupedMLP.forward, through
  the FP8 grouped GEMM.

Values: quantisation is DeepSeek-V3's (scale_inv = amax(block) / 448, q = w / scale_inv, e4m3),
dequantisation its `weight_dequant` (fp32 product, then the compute dtype), both equal to
moe_sft/conversion/fp8.py's reference functions (tests/cpu/test_peft_fp8_base.py). The blocks are
those of megatron's local matrix: at TP 1 / ETP 1 they are the source's 128x128 blocks, so a
base converted from an FP8 release (dequantised into bf16) re-quantises to the source's FP8 values
bit for bit, with per-block scales that dequantise to exactly the converted bf16 weight (the
source's own scale is one such scale; `_exact_scales`). A block the conversion permuted across
block boundaries, or a bf16 source, gets the amax scale. Tested on a tiny DeepSeek-V3 faked in FP8.

Loading and building without the base whole in bf16: fp8_loading.py.
"""

from __future__ import annotations

import re
import types

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from moe_sft.kernels.frozen_linear import input_grad_rows, linear_rows
from moe_sft.layers import expert_bias
from moe_sft.layers.experts import TorchGroupedMLP, grouped_matmul

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel ships no Triton
    triton = None

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SCALE = "_scale_inv"
# Dequantise / quantise at most this many elements at once (fp32 temporaries of 256 MiB).
_CHUNK_ELEMENTS = 2**26
_SKIPPED = ("output_layer", "embedding")
_SCALE_CANDIDATES = 32  # fp32 scales tried per block to reproduce a bf16 weight exactly
_LAYER = re.compile(r"^(decoder\.layers\.\d+\.|mtp\.layers\.\d+\.)")


# ----------------------------------------------------------------------------- block (de)quantisation


def _blocks(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def _padded(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = t.shape[-2:]
    br, bc = _blocks(rows, cols, block)
    pad_r, pad_c = br * block[0] - rows, bc * block[1] - cols
    return torch.nn.functional.pad(t, (0, pad_c, 0, pad_r)) if pad_r or pad_c else t


def _tiles(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(..., R, C) padded to whole blocks -> (..., R/bm, bm, C/bn, bn)."""
    t = _padded(t, block)
    *lead, rows, cols = t.shape
    return t.reshape(*lead, rows // block[0], block[0], cols // block[1], block[1])


def _chunks(n: int, per_item: int, limit: int = 0) -> list[slice]:
    step = max(1, (limit or _CHUNK_ELEMENTS) // max(per_item, 1))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scale_inv per block) of a (..., R, C) weight, blocks over its last two dims
    (conversion.fp8.quantize_blocks for every leading index, vectorised)."""
    *lead, rows, cols = weight.shape
    flat = weight.reshape(-1, rows, cols)
    q = torch.empty(flat.shape, dtype=FP8, device=weight.device)
    scale = torch.empty(flat.shape[0], *_blocks(rows, cols, block), dtype=torch.float32, device=weight.device)
    for part in _chunks(flat.shape[0], rows * cols, _CHUNK_ELEMENTS // 4):  # ~10 fp32 temporaries each
        tiles = _tiles(flat[part].float(), block)
        s = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX
        values = (tiles / s[:, :, None, :, None]).to(FP8)
        if weight.dtype == torch.bfloat16 or bool((tiles.to(torch.bfloat16).float() == tiles).all()):
            s = _exact_scales(tiles, values, s)  # bf16 values (in any dtype): from an FP8 source?
        scale[part] = s
        q[part] = values.flatten(-4, -3).flatten(-2, -1)[:, :rows, :cols]
    return q.reshape(weight.shape), scale.reshape(*lead, *scale.shape[1:])


def _exact_scales(tiles: torch.Tensor, values: torch.Tensor, amax_scale: torch.Tensor) -> torch.Tensor:
    """Per block, a scale that dequantises the FP8 `values` back to exactly the bf16 `tiles`, where
    one exists (a bf16 weight dequantised from an FP8 source: its FP8 values re-quantise to the
    source's bit for bit, and any scale inside every value's bf16 rounding interval reproduces the
    bf16 weight; the source's own scale is one of them). Else the amax scale (a bf16 source).

    Interval of element i (q_i != 0): bf16(q_i * s) == v_i  <=>  v_i - down_i <= q_i * s <= v_i + up_i,
    half a bf16 spacing each way (a quarter toward zero from an exact power of two, whose neighbour
    there is closer); then fp32 candidates from the blocks' intersection are checked."""
    q = values.float()
    mantissa, exponent = torch.frexp(tiles)
    spacing = torch.ldexp(torch.ones_like(tiles), exponent - 8)  # bf16: 8 significant bits
    toward_zero = torch.where(mantissa.abs() == 0.5, spacing / 4, spacing / 2) * tiles.sign()
    away = spacing / 2 * tiles.sign()
    lo_v, hi_v = torch.minimum(tiles - toward_zero, tiles + away), torch.maximum(tiles - toward_zero, tiles + away)
    nonzero = q != 0
    safe_q = torch.where(nonzero, q, torch.ones_like(q))
    a, b = lo_v / safe_q, hi_v / safe_q
    lo = torch.where(nonzero, torch.minimum(a, b), torch.full_like(q, -torch.inf)).amax(dim=(-3, -1))
    hi = torch.where(nonzero, torch.maximum(a, b), torch.full_like(q, torch.inf)).amin(dim=(-3, -1))
    usable = (lo <= hi) & torch.isfinite(lo) & torch.isfinite(hi) & (lo > 0)

    def exact(candidate):
        return usable & ((q * candidate[:, :, None, :, None]).to(torch.bfloat16).float() == tiles).all(dim=(-3, -1))

    # The intersection is a few fp32 values wide at most (each element narrows it to 2^-9 of s; the
    # products are rounded to fp32 before bf16): its midpoint, else each fp32 value from lo up.
    chosen, found = amax_scale.clone(), torch.zeros_like(usable)
    candidate = torch.where(usable, (lo + hi) / 2, amax_scale)
    for step in range(_SCALE_CANDIDATES + 1):
        hit = exact(candidate) & ~found
        chosen, found = torch.where(hit, candidate, chosen), found | hit
        if bool(found[usable].all()):
            break
        candidate = lo if step == 0 else torch.nextafter(candidate, torch.full_like(candidate, torch.inf))
        if bool((candidate[usable & ~found] > hi[usable & ~found]).all()):
            break
    return chosen


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """w = fp8 x scale_inv of its block, computed in fp32 and rounded once to `dtype`
    (DeepSeek-V3's weight_dequant; conversion.fp8.dequantize_blocks for every leading index).
    On CUDA one Triton pass (read 1 byte, write 2 per value); elsewhere torch ops in chunks."""
    if _triton_fits(q, block):
        return _dequantize_triton(q, scale, block, dtype)
    return dequantize_torch(q, scale, block, dtype)


def dequantize_torch(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK, dtype=torch.bfloat16):
    *lead, rows, cols = q.shape
    flat, flat_scale = q.reshape(-1, rows, cols), scale.reshape(-1, *scale.shape[-2:])
    out = torch.empty(flat.shape, dtype=dtype, device=q.device)
    for part in _chunks(flat.shape[0], rows * cols):
        tiles = _tiles(flat[part].float(), block) * flat_scale[part][:, :, None, :, None]
        out[part] = tiles.flatten(-4, -3).flatten(-2, -1)[:, :rows, :cols]
    return out.reshape(q.shape)


def _triton_fits(q: torch.Tensor, block: tuple[int, int]) -> bool:
    power_of_two = all(b & (b - 1) == 0 for b in block)
    return triton is not None and q.is_cuda and power_of_two and q.is_contiguous() and q.dtype == FP8


def _dequantize_triton(q, scale, block, dtype):
    *lead, rows, cols = q.shape
    experts = q.numel() // (rows * cols)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    br, bc = _blocks(rows, cols, block)
    scale = scale.contiguous()
    _dequant_kernel[(br, bc, experts)](q, scale, out, rows, cols, br, bc, BR=block[0], BC=block[1], num_warps=8)
    return out


if triton is not None:

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, out_ptr, rows, cols, s_rows, s_cols, BR: tl.constexpr, BC: tl.constexpr):
        """One block: fp8 -> fp32, times its scale (fp32), rounded to the output dtype (RNE)."""
        i, j, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        r = i * BR + tl.arange(0, BR)
        c = j * BC + tl.arange(0, BC)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        offsets = e * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
        values = tl.load(q_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + e * s_rows * s_cols + i * s_cols + j)
        tl.store(out_ptr + offsets, (values * s).to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- the GEMMs


class _Fp8FrozenLinear(torch.autograd.Function):
    """megatron's LinearWithFrozenWeight with the weight dequantised from FP8 on the fly (on rows,
    as kernels/frozen_linear.py computes it)."""

    @staticmethod
    def forward(ctx, x, q, scale, bias, allreduce_dgrad, tp_group, block):
        ctx.save_for_backward(q, scale)
        ctx.allreduce_dgrad, ctx.tp_group, ctx.block = allreduce_dgrad, tp_group, block
        ctx.bias_grad = bias is not None and bias.requires_grad
        out = linear_rows(x, dequantize(q, scale, block, x.dtype))
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        q, scale = ctx.saved_tensors
        grad_x = input_grad_rows(grad, dequantize(q, scale, ctx.block, grad.dtype))
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_x, group=ctx.tp_group)
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_grad else None
        return grad_x, None, None, grad_bias, None, None, None


class _Fp8GroupedMatmul(torch.autograd.Function):
    """x rows grouped by expert times the dequantised w[expert] (experts x in x out); input
    gradient only."""

    @staticmethod
    def forward(ctx, x, q, scale, tokens_per_expert, block):
        ctx.save_for_backward(q, scale, tokens_per_expert)
        ctx.block = block
        with torch.no_grad():
            return grouped_matmul(x, dequantize(q, scale, block, x.dtype), tokens_per_expert)

    @staticmethod
    def backward(ctx, grad):
        q, scale, tokens_per_expert = ctx.saved_tensors
        w = dequantize(q, scale, ctx.block, grad.dtype)
        with torch.no_grad():
            grad_x = grouped_matmul(grad.contiguous(), w.transpose(1, 2), tokens_per_expert)
        return grad_x, None, None, None, None


def _fp8_linear_impl(
    self,
    input,
    weight,
    bias,
    gradient_accumulation_fusion,
    allreduce_dgrad,
    sequence_parallel,
    tp_group,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
    **_,
):
    """Instance `_forward_impl` of an FP8 linear: the arguments of megatron's
    linear_with_frozen_weight (sequence-parallel gather, dgrad all-reduce), the weight from FP8."""
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    return _Fp8FrozenLinear.apply(input, weight, self.weight_scale_inv, bias, allreduce_dgrad, tp_group, self.fp8_block)


def _fp8_experts_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
    """TorchGroupedMLP.forward with both grouped GEMMs through the FP8 weights."""
    x, n, hidden = permuted_local_hidden_states, self.num_local_experts, self.config.hidden_size
    if x.numel() == 0:  # no weight gradient to keep alive; the probs' and adapters' collectives still run
        out = x * 0 + permuted_probs.sum() * 0
        return out + (self.adapter.zero_contribution() if self.adapter is not None else 0), None
    w1, w2 = self.weight1.view(n, hidden, -1), self.weight2.view(n, -1, hidden)
    h = _Fp8GroupedMatmul.apply(x, w1, self.weight1_scale_inv, tokens_per_expert, self.fp8_block)
    if self.bias1 is not None:  # gpt-oss: biased experts and its clamped SwiGLU, as TorchGroupedMLP
        h = h + expert_bias.per_row(self.bias1, tokens_per_expert, h.shape[0])
    if self.adapter is not None:
        h = h + self.adapter.fc1(x, tokens_per_expert)
    probs = permuted_probs.unsqueeze(-1)
    if self._extended_glu:
        h = expert_bias.extended_glu_with_probs(self.config, h, probs)
    else:
        h = self.activation_func_with_probs(h, probs)
    out = _Fp8GroupedMatmul.apply(h, w2, self.weight2_scale_inv, tokens_per_expert, self.fp8_block)
    if self.adapter is not None:
        out = out + self.adapter.fc2(h, tokens_per_expert)
    if self.bias2 is not None:
        out = expert_bias.fc2_bias(out, self.bias2, tokens_per_expert, permuted_probs, self.tp_group.rank())
    return out, None


# ----------------------------------------------------------------------------- install


def _weights(module) -> list[tuple[str, tuple[int, ...]]]:
    """(parameter name, shape its blocks are taken over) of an FP8-able module: a linear's
    (out x in) weight, a grouped MLP's (experts x in x out) stacks."""
    if isinstance(module, TorchGroupedMLP):
        n, hidden = module.num_local_experts, module.config.hidden_size
        return [("weight1", (n, hidden, -1)), ("weight2", (n, -1, hidden))]
    return [("weight", tuple(module.weight.shape))]


def frozen_base_modules(chunk):
    """(local name, module) of every module whose base weight goes to FP8: the frozen
    Column/RowParallelLinear and grouped experts outside the embedding and the LM head."""
    for name, module in chunk.named_modules():
        if name.startswith(_SKIPPED) or not isinstance(
            module, (ColumnParallelLinear, RowParallelLinear, TorchGroupedMLP)
        ):
            continue
        params = [getattr(module, p, None) for p, _ in _weights(module)]
        if all(p is not None and not p.requires_grad for p in params):
            yield name, module


def is_fp8(module) -> bool:
    return hasattr(module, "fp8_block")


def _store(module, name: str, shape, q: torch.Tensor, scale: torch.Tensor) -> None:
    """The FP8 values in place of the parameter (same 2-D shape), the scales beside them: both
    non-persistent buffers, so neither megatron's DDP and optimizer nor anything that walks the
    parameters (grad norms, checkpoint integrity, state dicts) sees a frozen FP8 tensor."""
    old = getattr(module, name)
    fp8 = q.reshape(old.shape)
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce"):
        if hasattr(old, attr):
            setattr(fp8, attr, getattr(old, attr))
    delattr(module, name)
    module.register_buffer(name, fp8, persistent=False)
    module.register_buffer(name + SCALE, scale, persistent=False)


def base_weight(module, name: str = "weight", dtype: torch.dtype | None = None) -> torch.Tensor:
    """A base weight as its module's parameter layout holds it: dequantised when it is FP8 (for a
    merge or an export: never rounded back into FP8), else the parameter itself."""
    weight = getattr(module, name)
    if not (is_fp8(module) and weight.dtype == FP8):
        return weight
    shape = dict(_weights(module))[name]
    value = dequantize(weight.view(shape), getattr(module, name + SCALE), module.fp8_block, dtype or module.base_dtype)
    return value.reshape(weight.shape)


def quantize_module(module, block: tuple[int, int] = BLOCK) -> None:
    """Replace the module's (bf16 / fp32) base weights by their FP8 values + block scales; the
    first call also routes its forward through the FP8 GEMMs."""
    if not is_fp8(module):
        module.base_dtype = getattr(module, _weights(module)[0][0]).dtype
    for name, shape in _weights(module):
        weight = getattr(module, name)
        if is_placeholder(weight):  # built by placeholder_base: the checkpoint fills it (load_quantised)
            q = torch.zeros(weight.shape, dtype=FP8, device=weight.device).view(shape)
            scale = torch.ones(q.shape[:-2] + _blocks(*q.shape[-2:], block), device=weight.device)
        else:
            q, scale = quantize(weight.detach().view(shape), block)
        _store(module, name, shape, q, scale)
        del weight
    if not is_fp8(module):
        module.fp8_block = tuple(block)
        if isinstance(module, TorchGroupedMLP):
            module.forward = types.MethodType(_fp8_experts_forward, module)
        else:
            module._forward_impl = types.MethodType(_fp8_linear_impl, module)


def install(chunks, block: tuple[int, int] = BLOCK) -> list[str]:
    """FP8 storage for every frozen base weight of `chunks` (after the adapters are added: they
    take their dtype from the base); the log lines."""
    count, before, after = 0, 0, 0
    for chunk in chunks:
        for _, module in frozen_base_modules(chunk):
            for name, _ in _weights(module):
                p = getattr(module, name)
                before += p.numel() * p.element_size()
            quantize_module(module, block)
            for name, _ in _weights(module):
                after += getattr(module, name).numel() + getattr(module, name + SCALE).numel() * 4
            count += 1
    return [
        f"peft.fp8_base: {count} frozen base modules held in FP8 (e4m3, {block[0]}x{block[1]} block scales), "
        f"{before / 2**30:.2f} -> {after / 2**30:.2f} GiB on this rank; dequantised per GEMM in forward and backward"
    ]


def fp8_modules(chunk):
    return [(name, m) for name, m in chunk.named_modules() if is_fp8(m)]


def dequantized_weights(chunk, dtype: torch.dtype = torch.float32):
    """(local state key, dequantised value) of every FP8 weight of `chunk` (tests, merge, export)."""
    for name, module in fp8_modules(chunk):
        for pname, _ in _weights(module):
            yield f"{name}.{pname}", base_weight(module, pname, dtype)


# ----------------------------------------------------------------------------- loading


def is_placeholder(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and 0 in t.stride()
