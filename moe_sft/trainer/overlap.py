"""Overlap of gradient reduction and parameter all-gather with compute (megatron DDP options).

With `overlap_grad_reduce`, megatron's DDP reduce(-scatter)s each gradient bucket as soon as its
last gradient is accumulated; the pipeline schedules start the final buckets themselves through
`config.grad_sync_func`. With `overlap_param_gather` the distributed optimizer no longer
all-gathers the updated parameters in its step: DDP's forward pre-hooks gather each bucket just
before the next forward uses it (`config.param_sync_func` lets the interleaved schedule start them
early). Until then the model's parameters are stale, so whatever reads them outside a forward —
a checkpoint save, the HF export, evaluation — must first sync them (`params_synced`).
This mirrors Megatron-LM's training loop.
"""

from __future__ import annotations

import contextlib


def _per_chunk(funcs: list):
    return funcs[0] if len(funcs) == 1 else funcs


def install_sync_funcs(tconfig, model_chunks, ddp_config) -> None:
    if ddp_config.overlap_grad_reduce:
        tconfig.grad_sync_func = _per_chunk([c.start_grad_sync for c in model_chunks])
    if ddp_config.overlap_param_gather:
        tconfig.param_sync_func = _per_chunk([c.start_param_sync for c in model_chunks])


@contextlib.contextmanager
def params_synced(model_chunks):
    """The updated parameters are in place for the duration (a no-op without param-gather overlap)."""
    overlapped = [c for c in model_chunks if getattr(c.ddp_config, "overlap_param_gather", False)]
    for chunk in overlapped:
        chunk.disable_forward_pre_hook(param_sync=True)  # all-gathers now, synchronously
    try:
        yield
    finally:
        for chunk in overlapped:
            chunk.enable_forward_pre_hook()
