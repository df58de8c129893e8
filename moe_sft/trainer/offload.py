"""Parameters, gradients and optimizer state to CPU memory between steps, and back (as verl does
for co-located jobs): megatron-core's own buffer and optimizer offload, in one place.

What moves: the DDP buffers (the bf16 parameters the distributed optimizer gathers into, and the
fp32 gradient buffers: their storage is freed, the views stay valid) and the optimizer's fp32 main
parameters and Adam moments. Frozen parameters live outside the buffers and stay. With CUDA
absent everything already is in CPU memory, so the calls do nothing.
"""

from __future__ import annotations

import torch


def _buffers(model_chunks):
    for chunk in model_chunks:
        yield from list(chunk.buffers) + list(chunk.expert_parallel_buffers)


def offload_to_cpu(model_chunks, optimizer) -> float:
    """Returns the GPU memory still allocated afterwards, in GiB (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    for buffer in _buffers(model_chunks):
        buffer.offload_to_cpu(move_params=True, move_grads=True)
    optimizer.offload_to_cpu()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**30


def reload_to_gpu(model_chunks, optimizer) -> None:
    if not torch.cuda.is_available():
        return
    for buffer in _buffers(model_chunks):
        buffer.reload_from_cpu(move_params=True, move_grads=True)
    optimizer.restore_from_cpu()
    torch.cuda.synchronize()
