"""Rotary embedding of packed (THD) sequences without host syncs, for context parallel size 1.

megatron-core 0.16.1's unfused `_apply_rotary_pos_emb_thd` reads the document lengths on the host
(`cu_seqlens.tolist()`, a tensor comparison in an `if`, `.item()` per document) to slice the
frequencies document by document. That is two to three host syncs per attention layer and
micro-batch, each one letting the GPU run dry (benchmarks/benchmark.py's host-sync census; the
counts: docs/log.md).

The slices it concatenates are, token by token, `freqs[position of the token in its document]`
(or `freqs[token index]` when `freqs` already has one row per packed token, which megatron
detects as `freqs.size(0) == cu_seqlens[-1]`; the split requires `cu_seqlens[-1] == tokens`, so
that is a host-side size test). Those positions come from `cu_seqlens` on the device, so one
gather replaces the loop. Context parallel keeps megatron's version (its per-rank halves).

On CUDA one Triton pass does the forward and one the backward. megatron's element-wise ops (cos,
sin, mul, neg, cat, add) are each a pass over [tokens, heads, head_dim] with its own launch, and
their autograd; one pass each way runs near a copy's speed (profile and timings: docs/log.md).
The kernels find a token's position by a binary search of cu_seqlens (no position tensor, no extra
launches), keep nothing per token for backward, and repeat the torch ops' roundings, so forward and
backward equal megatron's bit for bit (bf16: tests/gpu/test_gpu_rope.py; fp16 and fp32 too:
Triton's libdevice cosf / sinf are the functions torch's calls, docs/log.md).
rotary_interleaved (the models we build leave it False), fp64, a tensor mscale and CPU tensors take
the torch ops.
"""

from __future__ import annotations

import numbers

import torch
from megatron.core.models.common.embeddings import rope_utils

from moe_sft.kernels.triton_launch import launch
from moe_sft.runtime import patches

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice
except ImportError:  # CPU-only installs: torch's CPU wheel ships no Triton
    triton = None

_megatron_rope_thd = patches.original(rope_utils, "_apply_rotary_pos_emb_thd")

# Tiles, from a GPU sweep (docs/log.md): 4096 elements of each rotary half per program and 4 warps run
# a wide q near a plain copy's speed; smaller tensors (k as a slice of the QKV output) want more programs
# than that gives, so the tile halves down to 1024 until there are MIN_PROGRAMS at SWEEP_TOKENS.
TILE, MIN_TILE, MIN_PROGRAMS, NUM_WARPS, SWEEP_TOKENS = 4096, 1024, 1024, 4, 4096


def tile_elements(heads: int, half_block: int) -> int:
    """Elements of each rotary half per program: from the tensor's width per token, never its token
    count. The tile is a compile-time constant; sized from the micro-batch's token count, a short
    micro-batch late in a run would compile new kernels mid-run (~0.4 s each). The few programs a
    short micro-batch then gets cost microseconds."""
    tile = TILE
    while tile > MIN_TILE and SWEEP_TOKENS * heads * half_block < MIN_PROGRAMS * tile:
        tile //= 2
    return tile


def positions_in_documents(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Index of every packed token inside its document (segment of cu_seqlens), on the device."""
    tokens = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # the last segment start <= token (empty segments share a start: right=True skips them)
    segment = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    return (tokens - cu_seqlens.index_select(0, segment)).long()


# --------------------------------------------------------------------------- Triton (CUDA)
#
# megatron's `_apply_rotary_pos_emb_bshd` on the rotary part x = (x1, x2) (two halves; with MLA
# x1 = the even and x2 = the odd elements), each op rounding to t's dtype:
#     c = (cos(freqs) * mscale).to(dtype), s likewise        (in fp32)
#     y = (x1 c1 - x2 s1, x2 c2 + x1 s2)                       (each product rounded, then the sum)
# and it copies the rest of the head through. Autograd of those ops, for the gradient g = (g1, g2):
#     dx1 = g1 c1 + g2 s2,  dx2 = g2 c2 - g1 s1                 (same roundings)
# which is the forward with (s1, s2) -> (-s2, -s1) and the MLA pairing on the other side (the
# forward reads pairs and writes halves; the backward reads halves and writes pairs).

if triton is not None:
    # the micro-batch's counts vary: no recompile for each value's divisibility by 16
    @triton.jit(do_not_specialize=["search_steps", "last_boundary", "num_tokens"])
    def _rope_kernel(
        src_ptr,
        src_token_stride,
        src_head_stride,
        dst_ptr,
        dst_token_stride,
        dst_head_stride,
        freqs_ptr,
        freqs_row_stride,
        cu_seqlens_ptr,
        search_steps,
        last_boundary,
        num_tokens,
        num_heads,
        mscale,
        HALF: tl.constexpr,
        HALF_BLOCK: tl.constexpr,
        PASS: tl.constexpr,
        PASS_BLOCK: tl.constexpr,
        TOKEN_BLOCK: tl.constexpr,
        HEAD_BLOCK: tl.constexpr,
        FROM_DOCUMENTS: tl.constexpr,
        PAIRED: tl.constexpr,
        BACKWARD: tl.constexpr,
        LIBDEVICE_TRIG: tl.constexpr,
    ):
        """One block of tokens x heads: rotate the rotary part, copy the rest. Tiles are [tokens, heads, dims]."""
        tokens = tl.program_id(0) * TOKEN_BLOCK + tl.arange(0, TOKEN_BLOCK)
        heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
        token_ok = tokens < num_tokens
        if FROM_DOCUMENTS:  # position = token - (last cu_seqlens entry <= token), by bisection
            lo = tl.zeros([TOKEN_BLOCK], dtype=tl.int32)
            hi = tl.full([TOKEN_BLOCK], last_boundary, dtype=tl.int32)
            for _ in range(search_steps):
                mid = (lo + hi + 1) // 2
                at_or_before = tl.load(cu_seqlens_ptr + mid) <= tokens
                lo = tl.where(at_or_before, mid, lo)
                hi = tl.where(at_or_before, hi, mid - 1)
            positions = tokens - tl.load(cu_seqlens_ptr + lo)
        else:
            positions = tokens

        # cos / sin of the block's tokens, [TOKEN_BLOCK, 1, HALF_BLOCK]: computed once for all its heads
        dims = tl.arange(0, HALF_BLOCK)[None, None, :]
        angle_mask = token_ok[:, None, None] & (dims < HALF)
        angles = freqs_ptr + positions.to(tl.int64)[:, None, None] * freqs_row_stride + dims
        first = tl.load(angles, mask=angle_mask, other=0.0)
        second = tl.load(angles + HALF, mask=angle_mask, other=0.0)
        if LIBDEVICE_TRIG:  # CUDA's cosf / sinf, as torch.cos / torch.sin call
            cos1, sin1 = libdevice.cos(first), libdevice.sin(first)
            cos2, sin2 = libdevice.cos(second), libdevice.sin(second)
        else:  # the interpreter (a CPU check) has no libdevice
            cos1, sin1, cos2, sin2 = tl.cos(first), tl.sin(first), tl.cos(second), tl.sin(second)
        dtype = dst_ptr.dtype.element_ty
        cos1 = (cos1 * mscale).to(dtype).to(tl.float32)
        cos2 = (cos2 * mscale).to(dtype).to(tl.float32)
        sin1 = (sin1 * mscale).to(dtype).to(tl.float32)
        sin2 = (sin2 * mscale).to(dtype).to(tl.float32)
        if BACKWARD:
            sin1, sin2 = -sin2, -sin1

        rows_ok = token_ok[:, None, None] & (heads[None, :, None] < num_heads)
        tokens64 = tokens.to(tl.int64)[:, None, None]
        src_row = src_ptr + tokens64 * src_token_stride + heads[None, :, None] * src_head_stride
        dst_row = dst_ptr + tokens64 * dst_token_stride + heads[None, :, None] * dst_head_stride
        half_mask = rows_ok & (dims < HALF)
        # MLA pairs: one contiguous [.., 2 x HALF_BLOCK] access, split / interleaved in registers; strided
        # loads and stores of every other element, or split / join of [.., HALF_BLOCK, 2] pointers, were
        # several times slower (docs/log.md)
        pairs = tl.arange(0, 2 * HALF_BLOCK)[None, None, :]
        pairs_mask = rows_ok & (pairs < 2 * HALF)
        if PAIRED and not BACKWARD:
            x = tl.load(src_row + pairs, mask=pairs_mask, other=0.0)
            x1, x2 = tl.split(tl.reshape(x, [TOKEN_BLOCK, HEAD_BLOCK, HALF_BLOCK, 2]))
        else:
            x1 = tl.load(src_row + dims, mask=half_mask, other=0.0)
            x2 = tl.load(src_row + HALF + dims, mask=half_mask, other=0.0)
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        y1 = ((x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
        y2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
        if PAIRED and BACKWARD:
            tl.store(dst_row + pairs, tl.interleave(y1, y2), mask=pairs_mask)
        else:
            tl.store(dst_row + dims, y1, mask=half_mask)
            tl.store(dst_row + HALF + dims, y2, mask=half_mask)

        if PASS > 0:  # the dims past the rotary ones: copied (forward), their gradient passed on (backward)
            rest = tl.arange(0, PASS_BLOCK)[None, None, :]
            rest_mask = rows_ok & (rest < PASS)
            kept = tl.load(src_row + 2 * HALF + rest, mask=rest_mask)
            tl.store(dst_row + 2 * HALF + rest, kept, mask=rest_mask)


def _supported(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Shapes and dtypes the kernels handle: t [tokens, heads, head_dim], freqs fp32 [rows, 1, ..., rot_dim]."""
    rot_dim = freqs.shape[-1]
    return (
        t.dim() == 3
        and freqs.device == t.device
        and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and freqs.dtype == torch.float32
        and freqs.numel() == freqs.shape[0] * rot_dim
        and rot_dim % 2 == 0
        and 0 < rot_dim <= t.shape[-1]
        and t.shape[0] > 0
    )


def _rope_launch(src, cu_seqlens, freqs, multi_latent_attention, mscale, backward):
    if src.stride(-1) != 1:
        src = src.contiguous()
    tokens, heads, head_dim = src.shape
    rot_dim = freqs.shape[-1]
    freqs = freqs.reshape(freqs.shape[0], rot_dim)
    if freqs.stride(-1) != 1:
        freqs = freqs.contiguous()
    dst = torch.empty((tokens, heads, head_dim), dtype=src.dtype, device=src.device)
    half = rot_dim // 2
    half_block = triton.next_power_of_2(half)
    tile = tile_elements(heads, half_block)
    head_block = min(heads & -heads, max(1, tile // half_block))  # a power of two dividing heads: no idle lanes
    token_block = max(1, tile // (half_block * head_block))
    from_documents = cu_seqlens is not None
    boundaries = cu_seqlens.numel() if from_documents else 1
    grid = (triton.cdiv(tokens, token_block), triton.cdiv(heads, head_block))
    launch(
        _rope_kernel,
        grid,
        src,
        src.stride(0),
        src.stride(1),
        dst,
        dst.stride(0),
        dst.stride(1),
        freqs,
        freqs.stride(0),
        cu_seqlens if from_documents else freqs,
        (boundaries - 1).bit_length(),
        boundaries - 1,
        tokens,
        heads,
        float(mscale),
        HALF=half,
        HALF_BLOCK=half_block,
        PASS=head_dim - rot_dim,
        PASS_BLOCK=triton.next_power_of_2(max(1, head_dim - rot_dim)),
        TOKEN_BLOCK=token_block,
        HEAD_BLOCK=head_block,
        FROM_DOCUMENTS=from_documents,
        PAIRED=bool(multi_latent_attention),
        BACKWARD=backward,
        LIBDEVICE_TRIG=src.is_cuda,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )  # no fma: torch rounds each product (matters for fp32 t)
    return dst


class _RopeThd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cu_seqlens, freqs, multi_latent_attention, mscale):
        ctx.save_for_backward(cu_seqlens, freqs)  # nothing per token: cos / sin are recomputed
        ctx.multi_latent_attention, ctx.mscale = multi_latent_attention, mscale
        return _rope_launch(t, cu_seqlens, freqs, multi_latent_attention, mscale, backward=False)

    @staticmethod
    def backward(ctx, grad):
        cu_seqlens, freqs = ctx.saved_tensors
        grad_t = _rope_launch(grad, cu_seqlens, freqs, ctx.multi_latent_attention, ctx.mscale, backward=True)
        return grad_t, None, None, None, None


def rope_thd_fused(t, cu_seqlens, freqs, multi_latent_attention=False, mscale=1.0):
    """The Triton kernels (any device Triton runs on, the interpreter's CPU tensors too).

    cu_seqlens None: freqs has one row per packed token. No gradient for freqs."""
    return _RopeThd.apply(t, cu_seqlens, freqs.detach(), multi_latent_attention, mscale)


def _fused_path_applies(t, freqs, rotary_interleaved, mscale) -> bool:
    return (
        triton is not None
        and t.is_cuda
        and not rotary_interleaved
        and isinstance(mscale, numbers.Real)
        and _supported(t, freqs)
    )


# --------------------------------------------------------------------------- megatron's entry point


def apply_rope_thd(
    t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, cp_group=None
):
    """megatron's `_apply_rotary_pos_emb_thd` (same arguments, same result)."""
    if cp_group is None or cp_group.size() != 1:
        return _megatron_rope_thd(
            t,
            cu_seqlens,
            freqs,
            rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention,
            mscale=mscale,
            cp_group=cp_group,
        )
    num_tokens = t.shape[0]
    one_row_per_token = freqs.size(0) == num_tokens
    if _fused_path_applies(t, freqs, rotary_interleaved, mscale) and (
        one_row_per_token or cu_seqlens.device == t.device
    ):
        return rope_thd_fused(
            t,
            None if one_row_per_token else cu_seqlens,
            freqs,
            multi_latent_attention=multi_latent_attention,
            mscale=mscale,
        )
    if one_row_per_token:
        freqs_packed = freqs[:num_tokens]
    else:
        freqs_packed = freqs.index_select(0, positions_in_documents(cu_seqlens, num_tokens))
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs_packed,
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention,
        mscale=mscale,
    ).squeeze(1)


def use_sync_free_rope() -> None:
    """megatron's `apply_rotary_pos_emb` looks the THD function up in its module at each call."""
    patches.swap(
        rope_utils, "_apply_rotary_pos_emb_thd", apply_rope_thd, group=patches.KERNELS, reason="sync-free THD rope"
    )
