"""RMSNorm's Triton kernels (CUDA): one pass forward, one backward (plus a small column sum).

Why: as `weight * F.rms_norm(x)`, the norms cost several passes each (the weight multiply and its
gradient, the weight gradient's reduction, torch's fused rms_norm forward and backward), far above
their memory floor (profile: docs/log.md). Here the forward reads x once and writes y; the backward reads x and dy once, writes dx
and each program's fp32 partial weight gradient ([programs, width], then one small sum). Narrow
rows (qk-norm: 128 wide, tokens x heads rows) go several to a program, so both passes run near
memory bandwidth (timings: docs/log.md). The math is moe_sft/layers/norm.py's (its docstring:
numerics, saves); that module picks these kernels where `triton_fits`.
"""

from __future__ import annotations

import functools

import torch

from moe_sft.kernels.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel ships no Triton
    triton = None

# Sizes from a GPU sweep (tiles of 2048-8192 elements, 1-8 backward programs per SM; docs/log.md): no
# setting won at every width of the Qwen3 / DeepSeek shapes, and these were near the best at all of them.
MAX_TRITON_WIDTH = 8192  # one row in registers; wider rows would spill
TILE_ELEMENTS = 4096  # elements a program holds per step: 32 rows of 128, 2 of 2048, 1 of 4096+
PROGRAMS_PER_SM = 4  # backward grid: more programs hid no more latency and cost a longer dw sum
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# False (kernels.fused=false, moe_sft/kernels/install.py): RMSNorm runs its torch ops by default.
ENABLED = True


if triton is not None:

    @triton.jit(do_not_specialize=["rows"])  # token counts: one compile for every micro-batch
    def _forward_kernel(
        x_ptr,
        x_row_stride,
        w_ptr,
        y_ptr,
        rstd_ptr,
        rows,
        width,
        inv_width,
        eps,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        OFFSET: tl.constexpr,
        ROUND_HAT: tl.constexpr,
    ):
        """ROWS rows: fp32 1/rms, the normalised value (rounded to x's dtype where ROUND_HAT), times
        OFFSET + the weight."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, BLOCK)
        inside = (row[:, None] < rows) & (col[None, :] < width)
        offset = row.to(tl.int64)[:, None] * x_row_stride + col[None, :]
        x = tl.load(x_ptr + offset, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_width + eps)  # mean as torch's: sum x (1/N)
        y_hat = x * rstd[:, None]
        if ROUND_HAT:
            y_hat = y_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + col, mask=col < width, other=0.0).to(tl.float32) + OFFSET
        y = y_hat * w[None, :]  # exact in fp32 for bf16/fp16 factors: one rounding, below
        tl.store(y_ptr + row.to(tl.int64)[:, None] * width + col[None, :], y.to(y_ptr.dtype.element_ty), mask=inside)
        tl.store(rstd_ptr + row, rstd, mask=row < rows)

    @triton.jit(do_not_specialize=["rows", "rows_per_program"])
    def _backward_kernel(
        x_ptr,
        x_row_stride,
        dy_ptr,
        dy_row_stride,
        w_ptr,
        rstd_ptr,
        dx_ptr,
        dw_partial_ptr,
        rows,
        width,
        inv_width,
        rows_per_program,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        OFFSET: tl.constexpr,
        ROUND_HAT: tl.constexpr,
    ):
        """dx for a contiguous run of rows, ROWS at a time; their fp32 sum of dy * y_hat into one
        row of dw_partial."""
        program = tl.program_id(0)
        first = program * rows_per_program
        col = tl.arange(0, BLOCK)
        w = tl.load(w_ptr + col, mask=col < width, other=0.0).to(tl.float32) + OFFSET
        dw = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for start in range(first, first + rows_per_program, ROWS):  # the last program's run may pass `rows`
            row = start + tl.arange(0, ROWS)
            inside = (row[:, None] < rows) & (col[None, :] < width)
            row64 = row.to(tl.int64)[:, None]
            x = tl.load(x_ptr + row64 * x_row_stride + col[None, :], mask=inside, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row64 * dy_row_stride + col[None, :], mask=inside, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row, mask=row < rows, other=0.0)
            x_hat = x * rstd[:, None]
            if ROUND_HAT:
                dw += dy * x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
            else:
                dw += dy * x_hat
            g = dy * w[None, :]
            mean_gx = tl.sum(g * x_hat, axis=1) * inv_width
            dx = (g - x_hat * mean_gx[:, None]) * rstd[:, None]
            tl.store(dx_ptr + row64 * width + col[None, :], dx.to(dx_ptr.dtype.element_ty), mask=inside)
        tl.store(dw_partial_ptr + program.to(tl.int64) * width + col, tl.sum(dw, axis=0), mask=col < width)

    @triton.jit(do_not_specialize=["rows"])
    def _column_sum_kernel(partial_ptr, out_ptr, rows, width, COLS: tl.constexpr, ROWS: tl.constexpr):
        """out = partial.sum(0) in fp32, stored in out's dtype. A few columns' partial rows, ROWS at
        a time: with ROWS >= rows (the usual case) one load, where a loop waits on memory once per
        step (faster than torch's sum(0) here: docs/log.md)."""
        col = tl.program_id(0) * COLS + tl.arange(0, COLS)
        total = tl.zeros((COLS,), dtype=tl.float32)
        for start in range(0, rows, ROWS):
            row = start + tl.arange(0, ROWS)
            inside = (row[:, None] < rows) & (col[None, :] < width)
            total += tl.sum(tl.load(partial_ptr + row[:, None] * width + col[None, :], mask=inside, other=0.0), axis=0)
        tl.store(out_ptr + col, total.to(out_ptr.dtype.element_ty), mask=col < width)


def output_dtype(x: torch.Tensor, weight: torch.Tensor, round_hat: bool) -> torch.dtype:
    """Qwen's order (round x-hat first) promotes with the weight; the round-once order
    (zero-centred Qwen3.5 / Gemma norms, `.type_as(x)` in transformers) returns x's dtype."""
    return torch.promote_types(x.dtype, weight.dtype) if round_hat else x.dtype


def _launch_shape(width: int) -> tuple[int, int, int]:
    """(BLOCK columns, rows per tile, warps) for rows of `width`."""
    block = max(16, triton.next_power_of_2(width))
    rows = max(1, TILE_ELEMENTS // block)
    return block, rows, min(16, max(4, rows * block // 512))


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[rows, width] with unit column stride: a view when the leading dims flatten to one stride
    (k of a split QKV output does), else a contiguous copy."""
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:
        rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the Triton interpreter (CPU tensors): still several programs and several tiles each
    return torch.cuda.get_device_properties(device).multi_processor_count


def forward_triton(x, weight, eps, offset=0.0, round_hat=True):
    width = x.shape[-1]
    rows = _as_rows(x)
    y = torch.empty(x.shape, device=x.device, dtype=output_dtype(x, weight, round_hat))
    rstd = torch.empty(rows.shape[0], device=x.device, dtype=torch.float32)
    if rows.shape[0]:
        block, tile_rows, warps = _launch_shape(width)
        launch(
            _forward_kernel,
            (triton.cdiv(rows.shape[0], tile_rows),),
            rows,
            rows.stride(0),
            weight.contiguous(),
            y,
            rstd,
            rows.shape[0],
            width,
            1.0 / width,
            eps,
            BLOCK=block,
            ROWS=tile_rows,
            OFFSET=offset,
            ROUND_HAT=round_hat,
            num_warps=warps,
        )
    return y, rstd


def backward_triton(dy, x, weight, rstd, need_dx, need_dw, offset=0.0, round_hat=True):
    width = x.shape[-1]
    x_rows, dy_rows = _as_rows(x), _as_rows(dy)
    n = x_rows.shape[0]
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if n == 0:
        return dx, torch.zeros_like(weight)
    block, tile_rows, warps = _launch_shape(width)
    programs = min(triton.cdiv(n, tile_rows), _multiprocessors(x.device) * PROGRAMS_PER_SM)
    rows_per_program = triton.cdiv(triton.cdiv(n, programs), tile_rows) * tile_rows  # whole tiles each
    programs = triton.cdiv(n, rows_per_program)
    dw_partial = torch.empty(programs, width, device=x.device, dtype=torch.float32)
    launch(
        _backward_kernel,
        (programs,),
        x_rows,
        x_rows.stride(0),
        dy_rows,
        dy_rows.stride(0),
        weight.contiguous(),
        rstd,
        dx,
        dw_partial,
        n,
        width,
        1.0 / width,
        rows_per_program,
        BLOCK=block,
        ROWS=tile_rows,
        OFFSET=offset,
        ROUND_HAT=round_hat,
        num_warps=warps,
    )
    if not need_dw:
        return dx, None
    dw = torch.empty_like(weight)
    partial_rows = min(512, triton.next_power_of_2(programs))  # all of them on a 132-SM GPU
    cols = max(16, TILE_ELEMENTS // partial_rows)
    launch(
        _column_sum_kernel,
        (triton.cdiv(width, cols),),
        dw_partial,
        dw,
        programs,
        width,
        COLS=cols,
        ROWS=partial_rows,
        num_warps=8,
    )
    return (dx if need_dx else None), dw


def triton_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes the Triton kernels by default: CUDA, fp32/bf16/fp16, width <= 8192."""
    return (
        ENABLED
        and triton is not None
        and x.is_cuda
        and x.dtype in _TRITON_DTYPES
        and weight.dtype in _TRITON_DTYPES
        and 0 < x.shape[-1] <= MAX_TRITON_WIDTH
    )
