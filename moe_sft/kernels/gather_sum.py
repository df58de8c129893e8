"""out[n] = sum of src[index[n, j]] over j (index -1: nothing), in one pass on CUDA.

The MoE combine (and the dispatch's backward) sums each token's k expert rows. Done as torch ops
it copies the rows into a zeroed [tokens, k, hidden] buffer (`index_copy_`) and reduces it: three
passes (copy, zero fill, sum; benchmarks/benchmark.py's per-phase ops, figures in docs/log.md).
The Triton kernel reads each row once where it lies and writes the sum (fp32 accumulation, one
rounding, rows added in slot order): about half the traffic per call, and no atomics, so
the result stays deterministic. CPU and fp64 run the same sum as torch ops.
"""

from __future__ import annotations

import torch

from moe_sft.kernels.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel ships no Triton
    triton = None

BLOCK_H = 1024  # hidden columns per program: 128 threads x 8 bf16 (16-byte loads)


def _gather_sum_torch(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if src.shape[0] == 0:  # no rows (an EP rank whose experts got no token): every slot is empty
        return src.new_zeros(index.shape[0], src.shape[-1])
    rows = src.index_select(0, index.clamp_min(0).reshape(-1)).view(*index.shape, src.shape[-1])
    rows = rows.masked_fill((index < 0).unsqueeze(-1), 0)
    return rows.sum(dim=1)  # bf16: accumulated in fp32, rounded once


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(
        src_ptr, src_stride, index_ptr, out_ptr, out_stride, hidden, WIDTH: tl.constexpr, BLOCK: tl.constexpr
    ):
        """One token's block of columns: its rows' sum, in slot order, accumulated in fp32."""
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(WIDTH):  # unrolled (WIDTH is top-k): the row loads issue together
            row = tl.load(index_ptr + token * WIDTH + j)
            present = row >= 0
            x = tl.load(src_ptr + tl.where(present, row, 0) * src_stride + cols, mask=inside & present, other=0.0)
            acc += x.to(tl.float32)
        tl.store(out_ptr + token * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def _uses_triton(src: torch.Tensor) -> bool:
    return triton is not None and src.is_cuda and src.dtype in (torch.bfloat16, torch.float16, torch.float32)


def gather_sum(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[N, H] sums of src's rows [R, H] named by index [N, W] (int64; -1 marks an empty slot)."""
    num_out, width = index.shape
    hidden = src.shape[-1]
    if not _uses_triton(src) or 0 in (num_out, width, hidden):
        return _gather_sum_torch(src, index)
    if src.stride(-1) != 1:
        src = src.contiguous()
    out = src.new_empty(num_out, hidden)
    launch(
        _gather_sum_kernel,
        (num_out, triton.cdiv(hidden, BLOCK_H)),
        src,
        src.stride(0),
        index.contiguous(),
        out,
        out.stride(0),
        hidden,
        WIDTH=width,
        BLOCK=BLOCK_H,
        num_warps=4,
    )
    return out
