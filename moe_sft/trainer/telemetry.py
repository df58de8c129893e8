"""Per-step telemetry beyond the loss: MoE routing statistics, model TFLOP/s per GPU and MFU,
peak memory, and the rank-0 progress line with an ETA. Definitions: docs/telemetry.md.

The trainer makes one `Telemetry` after loading the weights and calls `step_metrics` at the end
of every step. Everything a step needs is gathered with one all-reduce (SUM) of one float64
vector over the world, laid out as
  [MoE statistics (moe_stats.MoERoutingStats.take) | model FLOPs, real tokens | per-rank peak memory]
each part pre-weighted so the sum counts every token, layer and micro-batch once. Peak memory
is max-reduced with a sum: each rank writes its own slots and zeros elsewhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from moe_sft.runtime.logs import get_logger
from moe_sft.trainer import flops
from moe_sft.trainer.moe_stats import MoERoutingStats
from moe_sft.trainer.progress import Progress

GIB = 1024**3
log = get_logger(__name__)


def resolve_peak_tflops(configured: float, device: str, precision: str) -> tuple[float | None, str]:
    """(peak TFLOP/s per GPU or None, where it came from)."""
    if configured > 0:
        return configured, "trainer.peak_tflops"
    if device != "cuda":
        return None, f"no default peak on {device}; set trainer.peak_tflops to report MFU"
    name = torch.cuda.get_device_name()
    peak = flops.default_peak_tflops(name) if precision == "bf16" else None
    if peak is None:
        return None, f"no default {precision} peak for {name!r}; set trainer.peak_tflops to report MFU"
    return peak, f"bf16 dense peak of {name}"


class Telemetry:
    def __init__(
        self,
        *,
        config,
        model_chunks,
        vocab_size: int,
        run_mtp: bool,
        device: str,
        precision: str,
        peak_tflops: float,
        log_interval: int,
        max_steps: int,
    ):
        self.device, self.log_interval, self.max_steps = device, log_interval, max_steps
        self.shape = flops.ModelShape.from_config(config, vocab_size, run_mtp=run_mtp)
        self.moe = MoERoutingStats(model_chunks, config, device) if config.num_moe_experts else None
        self.peak, peak_source = resolve_peak_tflops(peak_tflops, device, precision)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # Who contributes what to the sum (see the module docstring and moe_stats):
        self.tokens_weight = float(config.sequence_parallel or tp_rank == 0)
        self.bias_weight = float(
            tp_rank == 0 and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
        )
        self.data_weight = float(
            tp_rank == 0
            and parallel_state.get_context_parallel_rank() == 0
            and parallel_state.get_pipeline_model_parallel_rank() == 0
        )
        self.progress = Progress()
        self.run_peak_gib = (0.0, 0.0)  # this rank's (allocated, reserved) peak over all steps so far
        if self.rank == 0:
            per_token = sum(flops.forward_flops_per_token(self.shape).values())
            mfu = (
                f"MFU against {self.peak:g} TFLOP/s per GPU ({peak_source})"
                if self.peak
                else f"MFU not reported: {peak_source}"
            )
            log.info(
                f"telemetry: model FLOPs per token {3 * per_token / 1e9:.4g} GFLOP "
                f"(forward+backward, plus attention over each document); {mfu}"
            )

    def _local_vector(self, micro_batches) -> torch.Tensor:
        parts = [self.moe.take(self.tokens_weight, self.bias_weight)] if self.moe else []
        step_flops = flops.train_step_flops(self.shape, micro_batches) * self.data_weight
        real_tokens = sum(sum(flops.document_lengths(mb)) for mb in micro_batches) * self.data_weight
        memory = torch.zeros(2 * self.world, dtype=torch.float64)
        if self.device == "cuda":
            memory[self.rank] = torch.cuda.max_memory_allocated() / GIB
            memory[self.world + self.rank] = torch.cuda.max_memory_reserved() / GIB
            # the next step's peak starts now; this rank's peak over the run is kept here instead
            self.run_peak_gib = tuple(
                max(a, float(b)) for a, b in zip(self.run_peak_gib, memory[self.rank :: self.world])
            )
            torch.cuda.reset_peak_memory_stats()
        host = torch.cat([torch.tensor([float(step_flops), float(real_tokens)], dtype=torch.float64), memory])
        return torch.cat(parts + [host.to(self.device)])

    def step_metrics(self, step: int, micro_batches, seconds: float) -> dict:
        """Metrics of step `step` (0-based) that took `seconds`; prints the progress line on log steps.

        Collective: every rank calls it once per step. Returns {} on ranks other than 0.
        """
        self.progress.tick()
        vector = self._local_vector(micro_batches)
        dist.all_reduce(vector)
        if self.rank != 0:
            return {}
        reduced = vector.cpu()
        metrics = self.moe.metrics(reduced[: self.moe.size()]) if self.moe else {}
        host = reduced[self.moe.size() if self.moe else 0 :]
        step_tflop = float(host[0]) / 1e12
        tflops_per_gpu = step_tflop / max(seconds, 1e-9) / self.world
        metrics["perf/tflops_per_gpu"] = tflops_per_gpu
        if self.peak:
            metrics["perf/mfu_pct"] = 100.0 * tflops_per_gpu / self.peak
        metrics["perf/detail/model_tflop_per_step"] = step_tflop
        metrics["perf/detail/real_tokens"] = float(host[1])
        if self.device == "cuda":
            metrics["memory/max_allocated_gib"] = float(host[2 : 2 + self.world].max())
            metrics["memory/max_reserved_gib"] = float(host[2 + self.world :].max())
        if (step + 1) % self.log_interval == 0 or step + 1 == self.max_steps:
            log.info(self.progress.line(step + 1, self.max_steps))
        return metrics
