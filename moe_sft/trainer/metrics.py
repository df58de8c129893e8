"""Metrics: TensorBoard scalars and one console line per log interval (rank 0 only).

Names are `section/name`; the console line shows `name=value` for those, and names with more
parts (`moe/layer_3/max_load_ratio`, `moe/summary/load_entropy`) go to TensorBoard only, so the
line stays short whatever the number of layers. `Histogram` values go to TensorBoard only.
Metric definitions: docs/telemetry.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core.transformer.moe import moe_utils

AUX_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


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
            tracker[name] = {
                "values": torch.zeros(layers, device=device),
                "reduce_group": None,
                "avg_group": None,
                "reduce_group_has_dp": False,
            }
    moe_utils.reduce_aux_losses_tracker_across_ranks(names)
    out = {}
    for name in names:
        values = tracker[name]["values"].float()
        moe_layers = max(int((values != 0).sum().item()), 1)
        out[f"moe/{name}"] = values.sum().item() / moe_layers / max(num_microbatches, 1)
    moe_utils.clear_aux_losses_tracker()
    return out


@dataclass
class Histogram:
    """Counts per integer bin 0..n-1 (e.g. tokens per expert id), written as a TensorBoard
    histogram with one bucket per bin, so the exact counts read back from the event file."""

    counts: list[float]

    def write(self, writer, tag: str, step: int) -> None:
        ids = [i for i, c in enumerate(self.counts) if c]
        if not ids:
            return
        writer.add_histogram_raw(
            tag,
            min=float(ids[0]),
            max=float(ids[-1]),
            num=float(sum(self.counts)),
            sum=float(sum(i * c for i, c in enumerate(self.counts))),
            sum_squares=float(sum(i * i * c for i, c in enumerate(self.counts))),
            bucket_limits=[i + 0.5 for i in range(len(self.counts))],
            bucket_counts=list(self.counts),
            global_step=step,
        )


def on_console(name: str) -> bool:
    return name.count("/") <= 1


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
            if isinstance(value, Histogram):
                value.write(self.writer, name, step)
            else:
                self.writer.add_scalar(name, value, step)
        self.writer.flush()
        shown = " ".join(
            f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items() if on_console(k) and not isinstance(v, Histogram)
        )
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


def peak_memory_per_rank(device: str, earlier_gib: tuple[float, float] = (0.0, 0.0)) -> list[tuple[float, float]]:
    """(peak allocated, peak reserved) GiB of every rank since the last reset, or `earlier_gib`
    (this rank's peaks before that reset) where larger; [] unless on CUDA.

    A collective (all ranks call it). The planner's calibration (benchmarks/gpu/plan_calibration.py)
    compares these with `python -m moe_sft.plan`'s per-stage prediction.
    """
    import torch.distributed as dist

    if device != "cuda":
        return []
    mine = (
        torch.tensor(
            [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()], dtype=torch.float64, device="cuda"
        )
        / 2**30
    )
    mine = torch.maximum(mine, torch.tensor(earlier_gib, dtype=torch.float64, device="cuda"))
    every = torch.zeros(dist.get_world_size() * 2, dtype=torch.float64, device="cuda")
    dist.all_gather_into_tensor(every, mine)
    values = every.tolist()
    return [(values[2 * r], values[2 * r + 1]) for r in range(dist.get_world_size())]
