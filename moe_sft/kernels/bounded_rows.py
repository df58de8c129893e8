"""Row-wise kernels of the experts that stop at a row count held on the device.

With static rows (moe_sft/kernels/permute.py `BoundedRows`) a rank's local permutation always has
the same row count, capped at 2x its expected routed rows by default: the routed rows first, then
padding that no result reads. The grouped GEMMs already stop at the last expert's offset, but the
row gather (forward, and the combine's backward) and the SwiGLU x probs (forward and backward) ran
over every row: at EP4 about as many padding rows as routed ones, and the padding cost time
(docs/log.md). Here each of those reads the routed row count from the
device (no host sync, so it works inside a CUDA graph) and a program past it returns at once:
padding rows are never read or written (the gain at EP4 with graphs: docs/log.md).

The math is megatron's: `x[index]`, and GroupedMLP's `activation_func_with_probs` for SwiGLU
(silu(gate) x up x prob, computed in fp32 and rounded once, as its compiled kernel does). On CPU,
or without Triton, callers run megatron's ops over every row.
"""

from __future__ import annotations

import torch

from moe_sft.kernels.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel ships no Triton
    triton = None

BLOCK_H = 1024  # columns per program: 128 threads x 8 bf16 (16-byte loads)
# False: every row is gathered and activated, padding too (the benchmark's `--padding-rows compute`,
# the A/B of these kernels)
ENABLED = True

if triton is not None:

    @triton.jit
    def _gather_rows_kernel(
        src_ptr, src_stride, index_ptr, bound_ptr, out_ptr, out_stride, hidden, BLOCK: tl.constexpr
    ):
        """out[row] = src[index[row]] for a row below the bound."""
        row = tl.program_id(0).to(tl.int64)
        if row < tl.load(bound_ptr):
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            inside = cols < hidden
            source = tl.load(index_ptr + row)
            x = tl.load(src_ptr + source * src_stride + cols, mask=inside)
            tl.store(out_ptr + row * out_stride + cols, x, mask=inside)

    @triton.jit
    def _swiglu_probs_forward(h_ptr, h_stride, probs_ptr, bound_ptr, out_ptr, out_stride, ffn, BLOCK: tl.constexpr):
        """out[row] = silu(gate) x up x prob, in fp32, rounded once."""
        row = tl.program_id(0).to(tl.int64)
        if row < tl.load(bound_ptr):
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            inside = cols < ffn
            gate = tl.load(h_ptr + row * h_stride + cols, mask=inside).to(tl.float32)
            up = tl.load(h_ptr + row * h_stride + ffn + cols, mask=inside).to(tl.float32)
            prob = tl.load(probs_ptr + row).to(tl.float32)
            y = gate * tl.sigmoid(gate) * up * prob
            tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _swiglu_probs_backward(
        grad_ptr,
        grad_stride,
        h_ptr,
        h_stride,
        probs_ptr,
        bound_ptr,
        grad_h_ptr,
        grad_h_stride,
        grad_probs_ptr,
        ffn,
        BLOCK: tl.constexpr,
    ):
        """A row's gradients: of gate and up, and of its prob (the row's sum of grad x silu(gate) x up)."""
        row = tl.program_id(0).to(tl.int64)
        if row < tl.load(bound_ptr):
            prob = tl.load(probs_ptr + row).to(tl.float32)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, ffn, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < ffn
                g = tl.load(grad_ptr + row * grad_stride + cols, mask=inside, other=0.0).to(tl.float32)
                gate = tl.load(h_ptr + row * h_stride + cols, mask=inside, other=0.0).to(tl.float32)
                up = tl.load(h_ptr + row * h_stride + ffn + cols, mask=inside, other=0.0).to(tl.float32)
                sig = tl.sigmoid(gate)
                silu = gate * sig
                acc += g * silu * up
                scaled = g * prob
                grad_gate = scaled * up * sig * (1.0 + gate * (1.0 - sig))
                out = grad_h_ptr + row * grad_h_stride + cols
                tl.store(out, grad_gate.to(grad_h_ptr.dtype.element_ty), mask=inside)
                tl.store(out + ffn, (scaled * silu).to(grad_h_ptr.dtype.element_ty), mask=inside)
            tl.store(grad_probs_ptr + row, tl.sum(acc, axis=0))


def applies(x: torch.Tensor) -> bool:
    """Whether these kernels run for `x` (CUDA, Triton, a 16-bit or fp32 row tensor)."""
    return ENABLED and triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def gather_rows(
    src: torch.Tensor, index: torch.Tensor, bound: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """src[index] ([R, H]) into `out` (a new tensor by default); rows at or past `bound` (a 0-dim
    integer tensor on the device) are left unwritten. Without a bound, or off CUDA, `index_select`
    over every row."""
    hidden = src.shape[-1]
    if bound is None or not applies(src) or 0 in (index.shape[0], hidden):
        return src.index_select(0, index) if out is None else torch.index_select(src, 0, index, out=out)
    if src.stride(-1) != 1:
        src = src.contiguous()
    out = src.new_empty(index.shape[0], hidden) if out is None else out
    launch(
        _gather_rows_kernel,
        (index.shape[0], triton.cdiv(hidden, BLOCK_H)),
        src,
        src.stride(0),
        index.contiguous(),
        bound,
        out,
        out.stride(0),
        hidden,
        BLOCK=BLOCK_H,
        num_warps=4,
    )
    return out


class _SwigluWithProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, probs, bound):
        h, probs = h.contiguous(), probs.contiguous()
        ffn = h.shape[-1] // 2
        out = h.new_empty(h.shape[0], ffn)
        if h.shape[0]:
            launch(
                _swiglu_probs_forward,
                (h.shape[0], triton.cdiv(ffn, BLOCK_H)),
                h,
                h.stride(0),
                probs,
                bound,
                out,
                out.stride(0),
                ffn,
                BLOCK=BLOCK_H,
                num_warps=4,
            )
        ctx.save_for_backward(h, probs, bound)
        ctx.probs_shape = probs.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        h, probs, bound = ctx.saved_tensors
        grad = grad.contiguous()
        ffn = h.shape[-1] // 2
        grad_h = torch.empty_like(h)
        grad_probs = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        if h.shape[0]:
            launch(
                _swiglu_probs_backward,
                (h.shape[0],),
                grad,
                grad.stride(0),
                h,
                h.stride(0),
                probs,
                bound,
                grad_h,
                grad_h.stride(0),
                grad_probs,
                ffn,
                BLOCK=BLOCK_H,
                num_warps=4,
            )
        return grad_h, grad_probs.to(probs.dtype).view(ctx.probs_shape), None


def swiglu_with_probs(h: torch.Tensor, probs: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """silu(h[:, :F]) x h[:, F:] x probs for the rows below `bound` ([R, 2F], [R, 1] -> [R, F] in
    h's dtype); the rows past it are left unwritten, as are their gradients (see `applies`)."""
    return _SwigluWithProbs.apply(h, probs, bound)
