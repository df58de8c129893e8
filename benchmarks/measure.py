"""The timing loop every arm runs, and the record it produces (one per arm and token budget).

Per budget: `warmup` steps (not timed), `steps` timed steps (CUDA synchronised before and after
each; the step's batch is built before its timer starts), then `profile_steps` steps under
torch.profiler for the phase breakdown (benchmarks/phases.py), then on CUDA one step under
torch's sync debug mode: where the host waited for the GPU (`host_syncs`). Steps are numbered from 0 at
every budget, so every arm trains on the same batches (workload.Workload.global_batch(step)).

Throughput counts real tokens only (documents, never padding): tokens/s per GPU = timed real
tokens / timed seconds / GPUs. Model FLOPs come from moe_sft.trainer.flops (forward + backward =
3 x forward, active experts only, attention over each document's causal pairs); MFU = model
TFLOP/s per GPU / the peak (H100/H200 SXM dense bf16, moe_sft.models.shape.PEAK_BF16_TFLOPS).
A LoRA arm (moe-sft-lora, transformers-peft) keeps those units for its MFU (labelled: model FLOPs
of full SFT) and reports what its step executes beside them (`executed_flop`:
flops.lora_step_flops, forward + input gradients + adapter weight gradients, no frozen weight
gradient); tokens/s comes first in every report.
"""

from __future__ import annotations

import collections
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from benchmarks import phases as phase_mod
from benchmarks.workload import Workload, real_tokens
from moe_sft.models.shape import default_peak_tflops
from moe_sft.trainer import flops

PEAK_TFLOPS = default_peak_tflops("H100")  # the benchmark's GPUs (H100 / H200 SXM)


class Arm(Protocol):
    name: str
    device: str
    world: int
    rank: int

    def use(self, workload: Workload) -> None: ...
    def prepare(self, step: int) -> None: ...  # build the step's batch (untimed)
    def step(self, step: int) -> float: ...  # one full training step; returns the loss
    def install_scopes(self) -> phase_mod.Scopes: ...
    def fed(self) -> tuple[int, str]: ...  # real tokens and digest since reset_fed
    def reset_fed(self) -> None: ...
    def reset_peak(self) -> None: ...
    def peak_memory_gib(self) -> tuple[float, float]: ...  # (allocated, reserved) max over ranks


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def phase_flops(shape: flops.ModelShape, seqlens) -> dict[str, float]:
    """Model FLOPs (forward + backward) of the phases a ceiling exists for: routed experts and
    attention scores (the core attention kernel)."""
    tokens = sum(seqlens)
    mats = 3 if shape.glu else 2
    moe_layers = sum(shape.moe_layers) + (shape.mtp_layers if shape.moe_layers and shape.moe_layers[-1] else 0)
    return {
        "experts": 3.0 * tokens * moe_layers * shape.topk * mats * 2 * shape.hidden * shape.moe_ffn,
        "attention_core": 3.0 * flops.attention_score_flops(shape, seqlens),
    }


def host_sync_sites(run: Callable[[], None], device: str) -> dict[str, int] | None:
    """Where one call of `run` makes the host wait for the GPU, as {"file:line": count} (None
    without CUDA: nothing to wait for, and `run` is not called).

    torch.cuda.set_sync_debug_mode("warn") warns at every synchronising call (`.item()`,
    `nonzero`/`masked_select`, device-to-host or pageable host-to-device copies, stream syncs), and
    the warning carries the Python line that made the call. Each such wait lets the GPU run dry
    until the host has queued the next kernels: the gap between the phase sum and the step time."""
    if device != "cuda":
        return None
    sites: collections.Counter = collections.Counter()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            path = Path(w.filename)
            sites[f"{'/'.join(path.parts[-3:])}:{w.lineno}"] += 1
    return dict(sites.most_common())


def _one_time_events(device: str) -> collections.Counter:
    """Running totals of what makes a step slower once: a new Triton specialisation compiled through
    moe_sft/kernels/triton_launch.py (by kernel), a torch.compile graph compiled, the caching
    allocator freeing its cache to retry an allocation (a device sync)."""
    from moe_sft.kernels import triton_launch

    events = collections.Counter(f"triton {getattr(key[0], '__name__', key[0])}" for key in triton_launch._cache)
    try:
        from torch._dynamo.utils import counters

        events["compiled_graphs"] = counters["stats"]["unique_graphs"]  # a Counter: 0 before the first compile
    except ImportError:
        pass
    if device == "cuda":
        events["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    return events


def measure(
    arm: Arm,
    workload: Workload,
    shape: flops.ModelShape,
    *,
    warmup: int,
    steps: int,
    profile_steps: int,
    peak_tflops: float = PEAK_TFLOPS,
) -> dict:
    arm.use(workload)
    arm.reset_peak()
    for step in range(warmup):
        arm.prepare(step)
        arm.step(step)
    arm.reset_fed()
    seconds, losses, step_flops, step_tokens, step_events = [], [], [], [], {}
    executed_flops = []  # what the arm's kernels run: its LM head over the loss rows or every row
    for step in range(warmup, warmup + steps):
        arm.prepare(step)
        _sync(arm.device)
        before = _one_time_events(arm.device)
        start = time.perf_counter()
        losses.append(arm.step(step))
        _sync(arm.device)
        seconds.append(time.perf_counter() - start)
        new = _one_time_events(arm.device) - before  # Counter subtraction keeps the positive counts
        if new:
            step_events[step - warmup] = dict(new)
        batch = workload.global_batch(step)
        step_flops.append(flops.train_step_flops(shape, batch))
        if getattr(arm, "peft_plan", None) is not None:  # a LoRA step executes no frozen weight gradient
            executed_flops.append(
                flops.lora_step_flops(shape, batch, arm.peft_plan, heads_over_loss_rows=arm.heads_over_loss_rows)
            )
        else:
            executed_flops.append(
                flops.executed_step_flops(shape, batch) if arm.heads_over_loss_rows else step_flops[-1]
            )
        step_tokens.append(real_tokens(batch))
    model_flops, tokens = sum(step_flops), sum(step_tokens)
    fed_tokens, fed_digest = arm.fed()
    phases_ms, phase_ops, idle, profiled_s, phase_error, profiled_lens = {}, {}, {}, None, None, []
    profiled = range(warmup + steps, warmup + steps + profile_steps)
    if profile_steps:
        scopes = arm.install_scopes()
        try:

            def run(step):
                arm.prepare(step)  # one cached batch: built before the step's ops are profiled
                arm.step(step)

            phases_ms, profiled_s, phase_ops, idle = phase_mod.profile_steps(run, profiled, arm.device)
            profiled_lens = [n for s in profiled for mb in workload.global_batch(s) for n in flops.document_lengths(mb)]
        except Exception as err:  # keep the timed steps' results; say why the phases are missing
            phase_error = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        finally:
            scopes.remove()
    census_step = warmup + steps + profile_steps

    def census():
        arm.prepare(census_step)
        arm.step(census_step)

    host_syncs = host_sync_sites(census, arm.device)
    alloc, reserved = arm.peak_memory_gib()
    total_s = sum(seconds)
    tflops = model_flops / max(total_s, 1e-12) / arm.world / 1e12
    per_phase_flops = {k: v / max(profile_steps, 1) / arm.world for k, v in phase_flops(shape, profiled_lens).items()}
    if arm.name.endswith("-graphs"):  # the graphed layers' experts run inside the replay ("other"): only
        per_phase_flops.pop("experts", None)  # eager ones (MTP) are timed there, against every layer's FLOPs
    return dict(
        arm=arm.name,
        budget=workload.budget,
        micro_batches=workload.micro_batches,
        gpus=arm.world,
        device=arm.device,
        warmup=warmup,
        steps=steps,
        profile_steps=profile_steps,
        step_seconds=seconds,
        step_seconds_median=statistics.median(seconds) if seconds else None,
        real_tokens=tokens,
        real_tokens_per_step=tokens / max(steps, 1),
        fed_tokens=fed_tokens,
        fed_digest=fed_digest,
        model_flop=model_flops,
        model_flop_per_step=model_flops / max(steps, 1),
        tokens_per_s_per_gpu=tokens / max(total_s, 1e-12) / arm.world,
        tflops_per_gpu=tflops,
        executed_flop=sum(executed_flops),
        executed_flop_kind=(
            "LoRA step: forward, input gradients, adapter weight gradients"
            if getattr(arm, "peft_plan", None) is not None
            else "full SFT" + (", LM heads over the loss rows" if arm.heads_over_loss_rows else "")
        ),
        hw_tflops_per_gpu=sum(executed_flops) / max(total_s, 1e-12) / arm.world / 1e12,
        peak_tflops=peak_tflops,
        mfu_pct=100.0 * tflops / peak_tflops,
        peak_allocated_gib=alloc,
        peak_reserved_gib=reserved,
        losses=losses,
        phases_ms=phases_ms,
        phase_ops=phase_ops,
        gpu_idle=idle,
        profiled_step_seconds=profiled_s,
        phase_source="CUDA kernel time" if arm.device == "cuda" else "CPU op time",
        phase_error=phase_error,
        host_syncs=host_syncs,
        step_events=step_events,
        step_real_tokens=step_tokens,
        step_model_flop=step_flops,
        phase_tflops={k: v / (phases_ms[k] / 1e3) / 1e12 for k, v in per_phase_flops.items() if phases_ms.get(k)},
        status="ok",
    )
