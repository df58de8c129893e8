"""Metrics: TensorBoard scalars and one console line per log interval (rank 0 only)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from megatron.core.transformer.moe import moe_utils


def moe_aux_losses(num_microbatches: int) -> dict[str, float]:
    """Mean over MoE layers of each router loss megatron tracked this step (then cleared)."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if not tracker:
        return {}
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    out = {}
    for name, entry in tracker.items():
        values = entry["values"].float()
        layers = max(int((values != 0).sum().item()), 1)
        out[f"moe/{name}"] = values.sum().item() / layers / max(num_microbatches, 1)
    moe_utils.clear_aux_losses_tracker()
    return out


class MetricsLogger:
    def __init__(self, log_dir: Path, enabled: bool):
        self.enabled = enabled
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir))
        self._last = time.time()

    def log(self, step: int, max_steps: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()
        shown = " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items())
        print(f"step {step}/{max_steps} {shown}", flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Throughput:
    """Tokens per second per step (all ranks' tokens of the global batch)."""

    def __init__(self):
        self._start = None

    def start(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def stop(self, tokens: int) -> tuple[float, float]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self._start
        return tokens / max(seconds, 1e-9), seconds
