"""Expert weight gradients accumulated straight into megatron's fp32 `main_grad` (CUDA, Triton).

Without Transformer Engine or apex, megatron-core cannot fuse gradient accumulation: every
micro-batch writes a bf16 weight gradient, then DDP's hook adds it into the fp32 main grad (2 + 2
+ 4 + 4 bytes moved per parameter). The routed experts are 86% of the Qwen3-30B-A3B parameters
and see only ~256 tokens each per 4096-token micro-batch, so that traffic, not their FLOPs, set the
"grads" phase (its share of the step: docs/log.md). Here one grouped kernel
computes each expert's X_e^T · dY_e in fp32 registers and adds it into the main grad in its
epilogue (4 + 4 bytes per parameter, nothing for an expert without tokens), the way megatron's
`gradient_accumulation_fusion` does for dense layers with TE or apex: the weight's
`grad_added_to_main_grad` tells DDP's hook to skip its add, and the gradient autograd sees is an
unfilled placeholder, as in megatron's `LinearWithGradAccumulationAndAsyncCommunication`.

Used only when the weight has a `main_grad` (wrapped in megatron's DDP), the tensors are on CUDA
and Triton imports; elsewhere (CPU, tests without DDP) the experts keep `F.grouped_mm`'s autograd.

Overlap. Nothing in the backward pass waits for these additions: they only have to land before
the gradients are reduced or read. So the kernel runs on a side CUDA stream, where it is
memory-bound next to the compute-bound input-gradient GEMMs and attention of the backward
(`kernels.wgrad_overlap=false` keeps it on the compute stream). The compute stream waits for the side
stream at the end of each backward pass (an autograd engine callback), before megatron's gradient
reduction, the optimizer or anything else can read a main grad; the inputs are held for the side
stream (`record_stream`) so the allocator does not hand their memory out early. With
`overlap_grad_reduce` megatron starts a bucket's reduction inside the backward pass, as soon as
its gradients are marked ready: `guard_grad_sync` makes that start wait for the side stream too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_sft.kernels.triton_launch import launch
from moe_sft.runtime import patches

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel ships no Triton
    triton = None

# An output tile of BLOCK_K x BLOCK_N fp32 per program, the expert's rows in chunks of BLOCK_M.
# benchmarks/gpu/wgrad_sweep.py picked it among 32 candidates at Qwen3-30B-A3B's shapes (4096 tokens);
# its times against the memory floor and grouped_mm's bf16 weight gradient: docs/log.md.
TILES = dict(BLOCK_K=128, BLOCK_N=128, BLOCK_M=32, num_warps=4, num_stages=3)


# Set by moe_sft/kernels/install.py: ENABLED from kernels.fused, OVERLAP from kernels.wgrad_overlap
# (trainer/cuda_graphs.py turns OVERLAP off while it captures).
ENABLED = True
OVERLAP = True


def fuses(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the weight gradient of x @ weight can go straight into weight.main_grad."""
    return (
        ENABLED
        and triton is not None
        and x.is_cuda
        and torch.is_grad_enabled()
        and weight.requires_grad
        and getattr(weight, "main_grad", None) is not None
        and x.dtype == weight.dtype
    )


if triton is not None:

    @triton.jit
    def _accumulate_kernel(
        x_ptr,
        dy_ptr,
        ends_ptr,
        out_ptr,
        K,
        N,
        stride_xm,
        stride_xk,
        stride_ym,
        stride_yn,
        stride_oe,
        stride_ok,
        stride_on,
        BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.program_id(2)
        end = tl.load(ends_ptr + expert).to(tl.int64)
        start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
        if end > start:  # an expert without rows adds nothing: its main grad is not touched
            rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rows = tl.arange(0, BLOCK_M).to(tl.int64)
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
            for first in range(start, end, BLOCK_M):
                m = first + rows
                in_rows = m < end
                x_t = tl.load(
                    x_ptr + m[None, :] * stride_xm + rk[:, None] * stride_xk,
                    mask=in_rows[None, :] & (rk[:, None] < K),
                    other=0.0,
                )
                dy = tl.load(
                    dy_ptr + m[:, None] * stride_ym + rn[None, :] * stride_yn,
                    mask=in_rows[:, None] & (rn[None, :] < N),
                    other=0.0,
                )
                acc += tl.dot(x_t, dy)
            out = out_ptr + expert.to(tl.int64) * stride_oe + rk[:, None] * stride_ok + rn[None, :] * stride_on
            inside = (rk[:, None] < K) & (rn[None, :] < N)
            total = tl.load(out, mask=inside, other=0.0).to(tl.float32) + acc
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=inside)


def accumulate_grouped_wgrad(
    x: torch.Tensor, dy: torch.Tensor, ends: torch.Tensor, out: torch.Tensor, tiles: dict | None = None
) -> None:
    """out[e] += x[rows of e]^T @ dy[rows of e] for x [M, K], dy [M, N], out [E, K, N] (any float
    dtype; fp32 accumulation), `ends` the int32 cumulative row counts per expert (grouped_mm's offs)."""
    experts, k, n = out.shape
    if x.shape[1] != k or dy.shape[1] != n or ends.numel() != experts or x.shape[0] != dy.shape[0]:
        raise ValueError(
            f"grouped wgrad shapes: x {tuple(x.shape)}, dy {tuple(dy.shape)}, "
            f"{ends.numel()} groups, out {tuple(out.shape)}"
        )
    tiles = tiles or TILES
    grid = (triton.cdiv(k, tiles["BLOCK_K"]), triton.cdiv(n, tiles["BLOCK_N"]), experts)
    launch(_accumulate_kernel, grid, x, dy, ends, out, k, n, *x.stride(), *dy.stride(), *out.stride(), **tiles)


_side_streams: dict = {}  # device index -> the side stream
_joins: dict = {}  # (compute stream, side stream) -> True while a join is queued


def _join(compute: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
    compute.wait_stream(side)
    _joins.pop((compute, side), None)


class _overlapped:
    """Runs the enclosed kernel launches on the side stream, after the compute stream's work so far,
    and queues the compute stream's wait for them at the end of this backward pass."""

    def __init__(self, *inputs: torch.Tensor):
        self.inputs = inputs
        self.stream = None

    def __enter__(self):
        if not OVERLAP:
            return
        compute = torch.cuda.current_stream()
        side = _side_streams.setdefault(compute.device.index, torch.cuda.Stream(device=compute.device))
        side.wait_stream(compute)  # dy, x and the main grad are ready
        for t in self.inputs:
            t.record_stream(side)
        if (compute, side) not in _joins:
            _joins[(compute, side)] = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _join(compute, side))
        self.stream = torch.cuda.stream(side)
        self.stream.__enter__()

    def __exit__(self, *exc):
        if self.stream is not None:
            self.stream.__exit__(*exc)


def wait_for_side_streams() -> None:
    """The current stream waits for every side-stream addition queued so far on its device."""
    if _side_streams:
        current = torch.cuda.current_stream()
        side = _side_streams.get(current.device.index)
        if side is not None:
            current.wait_stream(side)


def guard_grad_sync() -> None:
    """megatron's bucket reductions (started during backward under overlap_grad_reduce) read the
    main grads: make each start wait for the side stream first."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    start = _ParamAndGradBucketGroup.start_grad_sync
    if getattr(start, "_moe_sft_guarded", False):
        return

    def start_grad_sync(self, *args, **kwargs):
        wait_for_side_streams()
        return start(self, *args, **kwargs)

    start_grad_sync._moe_sft_guarded = True
    patches.swap(
        _ParamAndGradBucketGroup,
        "start_grad_sync",
        start_grad_sync,
        group=patches.KERNELS,
        reason="bucket reductions wait for the experts' side-stream gradients",
    )


class GroupedMatmulIntoMainGrad(torch.autograd.Function):
    """x @ weight.view(shape)[expert of each row], with the weight gradient added into main_grad."""

    @staticmethod
    def forward(ctx, x, weight, ends, shape):
        ctx.save_for_backward(x, weight, ends)
        ctx.shape = shape
        return F.grouped_mm(x, weight.view(shape), offs=ends)

    @staticmethod
    def backward(ctx, dy):
        x, weight, ends = ctx.saved_tensors
        dy = dy.contiguous()
        dx = F.grouped_mm(dy, weight.view(ctx.shape).transpose(-2, -1), offs=ends)
        with _overlapped(x, dy, ends):
            accumulate_grouped_wgrad(x, dy, ends, weight.main_grad.view(ctx.shape))
        weight.grad_added_to_main_grad = True
        # DDP's hook must still fire for this weight (it marks the bucket ready); it sees
        # grad_added_to_main_grad and drops this placeholder without reading it.
        placeholder = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        return dx, placeholder, None, None


def _tiles_for(k: int, n: int) -> dict:
    """The default tiles, narrowed to a skinny side (a LoRA factor's rank) so no lanes idle."""
    fit = lambda d: max(16, min(128, triton.next_power_of_2(d)))
    return dict(TILES, BLOCK_K=fit(k), BLOCK_N=fit(n))


class GroupedMatmulKernelWgrad(torch.autograd.Function):
    """x @ w[expert of each row] (w: experts x K x N, a plain tensor), its gradient computed by the
    grouped wgrad kernel into a fresh fp32 buffer. torch's grouped_mm backward runs one cuBLAS GEMM
    per expert for skinny weights (rank-16 LoRA factors), which dominated a LoRA step (docs/log.md)."""

    @staticmethod
    def forward(ctx, x, w, ends):
        ctx.save_for_backward(x, w, ends)
        return F.grouped_mm(x, w, offs=ends)

    @staticmethod
    def backward(ctx, dy):
        x, w, ends = ctx.saved_tensors
        dy = dy.contiguous()
        dx = F.grouped_mm(dy, w.transpose(-2, -1), offs=ends)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        accumulate_grouped_wgrad(x, dy, ends, dw, _tiles_for(w.shape[1], w.shape[2]))
        return dx, dw.to(w.dtype), None


def kernel_wgrad_applies(x: torch.Tensor) -> bool:
    return ENABLED and triton is not None and x.is_cuda and torch.is_grad_enabled()
