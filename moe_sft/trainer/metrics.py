"""Metrics: TensorBoard scalars and one console line per log interval (rank 0 only)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from megatron.core.transformer.moe import moe_utils


AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}


def aux_loss_names(config) -> list[str]:
    """The names megatron's routers log for this config (same on every rank)."""
    if not config.num_moe_experts:
        return []
    types = config.moe_router_load_balancing_type
    types = types if isinstance(types, (list, tuple)) else [types]
    names = [AUX_LOSS_NAMES[t] for t in types if t in AUX_LOSS_NAMES]
    return names + (["z_loss"] if config.moe_z_loss_coeff else [])


def moe_aux_losses(config, num_microbatches: int) -> dict[str, float]:
    """Mean over MoE layers of each router loss megatron tracked this step (then cleared).

    The reduction is a collective over the pipeline group, so every stage must take part with
    the same names, including a stage without MoE layers (DeepSeek-V3's dense first layers):
    their entries are created empty here, as Megatron-LM's `force_initialize` does.
    """
    names = aux_loss_names(config)
    if not names:
        return {}
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    layers = config.num_layers + (config.mtp_num_layers or 0)
    for name in names:
        if name not in tracker:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            tracker[name] = {"values": torch.zeros(layers, device=device), "reduce_group": None,
                             "avg_group": None, "reduce_group_has_dp": False}
    moe_utils.reduce_aux_losses_tracker_across_ranks(names)
    out = {}
    for name in names:
        values = tracker[name]["values"].float()
        moe_layers = max(int((values != 0).sum().item()), 1)
        out[f"moe/{name}"] = values.sum().item() / moe_layers / max(num_microbatches, 1)
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

    def log(self, step: int, max_steps: int, metrics: dict[str, float], label: str = "step") -> None:
        if not self.enabled:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()
        shown = " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items())
        print(f"{label} {step}/{max_steps} {shown}", flush=True)

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
