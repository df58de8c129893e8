"""Pre-flight planner: layout validation, per-stage GPU memory, rank roles, a throughput estimate.

    python -m moe_sft.plan recipes/qwen3_235b_a22b.yaml [--gpus N] [--gpu-mem GiB] [key=value ...]
    torchrun ... -m moe_sft.train ... trainer.dry_run=true      (same plan + every rank's role)

Pure Python over the recipe and the model's HF config.json: no torch.distributed, no GPU, so it
runs on a laptop for any world size. The memory formula is in docs/planner.md.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace

from moe_sft.models.shape import ModelShape
from moe_sft.plan import hardware, memory, peft_memory, preflight
from moe_sft.plan.layout import Layout, layout_from_config
from moe_sft.plan.shapes import resolve_model
from moe_sft.runtime.logs import get_logger


@dataclass
class Plan:
    cfg: object
    shape: ModelShape
    shape_source: str
    layout: Layout
    gpu: hardware.GPU
    gpu_mem_gib: float
    train: memory.Training | None = None
    stages: list = field(default_factory=list)
    by_recompute: dict = field(default_factory=dict)  # recompute choice -> largest stage activations
    throughput: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    warnings: list = field(default_factory=list)

    @property
    def largest(self):
        return max(self.stages, key=lambda s: s.total) if self.stages else None

    @property
    def fits(self) -> bool:
        return self.largest is not None and self.largest.total <= self.gpu_mem_gib * memory.GIB

    @property
    def ok(self) -> bool:
        return not self.errors and self.fits


def world_size(cfg, gpus: int | None = None) -> int:
    """--gpus, else torchrun's WORLD_SIZE, else the recipe's hardware section."""
    if gpus:
        return gpus
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    return cfg.hardware.nodes * cfg.hardware.gpus_per_node


def training_of(cfg, lay: Layout, backend: str) -> memory.Training:
    m, t = cfg.model, cfg.trainer
    precision = "bf16" if t.precision in ("auto", "bf16") else "fp32"
    return memory.Training(
        tokens=cfg.data.pack_length,
        micro_batches=max(t.global_batch_size // max(lay.dp, 1), 1),
        recompute=m.recompute_granularity,
        recompute_method=m.recompute_method or "uniform",
        recompute_num_layers=m.recompute_num_layers or 1,
        precision=precision,
        distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        offload_fraction=cfg.optimizer.optimizer_offload_fraction if cfg.optimizer.optimizer_cpu_offload else 0.0,
        # as trainer/assemble.multi_token_prediction: a LoRA/DoRA run leaves the MTP layers frozen, not run
        mtp_trained=not m.freeze_mtp and m.mtp_loss_weight > 0 and cfg.peft.method == "none",
        backend=backend,
        peft=peft_memory.from_config(cfg.peft),
        cuda_graphs=t.cuda_graphs,
        static_rows_capacity=m.moe_static_rows_capacity,
    )


def make_plan(
    cfg, gpus: int | None = None, gpu_mem_gib: float | None = None, imbalance: float = 1.0, strict: bool = False
) -> Plan:
    """Validate `cfg` at the world size and compute memory per stage (no GPU, no process group).
    `strict`: data and checkpoint paths must exist here (the cluster's pre-flight)."""
    world = world_size(cfg, gpus)
    gpu = hardware.GPUS[cfg.hardware.gpu]
    shape, source, problems = resolve_model(cfg)
    backend = "te" if cfg.model.backend == "te" else "torch"
    lay = layout_from_config(cfg, world, topk=shape.topk)
    plan = Plan(
        cfg=cfg, shape=shape, shape_source=source, layout=lay, gpu=gpu, gpu_mem_gib=gpu_mem_gib or gpu.memory_gib
    )
    plan.errors, plan.warnings = preflight.layout_problems(cfg, world, shape, backend, strict)
    plan.errors += [f"[checkpoint] {p}" for p in problems + preflight.checkpoint_problems(cfg)]
    if world != cfg.hardware.nodes * cfg.hardware.gpus_per_node:
        plan.warnings.append(
            f"[hardware] planning for {world} GPUs; the recipe's hardware section says "
            f"{cfg.hardware.nodes} x {cfg.hardware.gpus_per_node}"
        )
    if plan.errors:  # sizes do not divide: a memory table would be meaningless
        return plan
    plan.warnings += preflight.schedule_warnings(cfg, lay)
    plan.train = training_of(cfg, lay, backend)
    plan.stages = memory.all_stages(shape, lay, plan.train, imbalance)
    worst = plan.largest.pp_rank
    for choice in (None, "selective", "full"):
        alt = memory.Training(**{**plan.train.__dict__, "recompute": choice})
        st = memory.stage_memory(shape, lay, worst, alt, imbalance)
        plan.by_recompute[choice or "none"] = (st.activations + st.working, st.total)
    plan.throughput = hardware.estimate_tokens_per_s(
        shape, lay, gpu, cfg.data.max_seq_len, plan.train.micro_batches, plan.train.recompute
    )
    if not plan.fits:
        fits, short = what_fits(plan, imbalance)
        advice = f"; fits with {' | '.join(fits)}" if fits else ""
        advice += f"; not enough alone: {', '.join(short)}" if short else ""
        plan.errors.append(
            f"[memory] stage {worst} needs {plan.largest.total / memory.GIB:.1f} GiB per GPU, more "
            f"than the {plan.gpu_mem_gib:.1f} GiB of a {gpu.name}{advice}; or more pipeline / "
            "expert-parallel ranks (or nodes)"
        )
    return plan


def _fix_candidates(plan: Plan) -> list[tuple[str, memory.Training]]:
    """One change of the recipe per entry (the overrides that make it, the Training it plans)."""
    t, data = plan.train, plan.cfg.data
    out = []
    if t.recompute != "full":
        full = "model.recompute_granularity=full model.recompute_method=uniform model.recompute_num_layers=1"
        out.append((full, replace(t, recompute="full", recompute_method="uniform", recompute_num_layers=1)))
    if t.peft is not None and not t.peft.fp8_base:
        out.append(("peft.fp8_base=true", replace(t, peft=replace(t.peft, fp8_base=True))))
    if t.offload_fraction < 1:
        offload = "optimizer.optimizer_cpu_offload=true optimizer.optimizer_offload_fraction=1.0"
        out.append((offload, replace(t, offload_fraction=1.0)))
    tokens = t.tokens // 2
    while tokens >= 1024:  # smaller micro-batches, halving (the largest that fits is kept)
        shorter = f"data.pack_length={tokens}" + (f" data.max_seq_len={tokens}" if tokens < data.max_seq_len else "")
        out.append((shorter, replace(t, tokens=tokens)))
        tokens //= 2
    return out


def what_fits(plan: Plan, imbalance: float = 1.0) -> tuple[list[str], list[str]]:
    """The planner's answer to "what would make it fit": each single change of `_fix_candidates`
    planned again, as (those that fit, those that do not), with their GiB per GPU. Of the shorter
    micro-batches only the longest that fits is named (or the shortest tried, when none does)."""
    fits, short = [], []
    limit = plan.gpu_mem_gib * memory.GIB
    shorter_fits = False
    for overrides, train in _fix_candidates(plan):
        total = max(st.total for st in memory.all_stages(plan.shape, plan.layout, train, imbalance))
        text = f"{overrides} ({total / memory.GIB:.1f} GiB)"
        is_shorter = overrides.startswith("data.pack_length=")
        if total <= limit and not (is_shorter and shorter_fits):
            fits.append(text)
            shorter_fits = shorter_fits or is_shorter
        elif total > limit and not is_shorter:
            short.append(text)
        elif total > limit and not shorter_fits and train.tokens < 2048:
            short.append(text)  # the shortest tried does not fit either
    return fits, short


def dry_run(cfg, gpus: int | None = None) -> int:
    """trainer.dry_run=true: the plan and every rank's role, then exit (0 when it would run)."""
    from moe_sft.config.schema import ConfigError
    from moe_sft.plan.plan_text import format_plan, format_roles

    try:
        plan = make_plan(cfg, gpus)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") != "0":  # under torchrun: one copy of the plan, same exit status
        return 0 if plan.ok else 2
    print(format_plan(plan))
    if not plan.errors:
        print("\n".join(format_roles(plan)))
    get_logger(__name__).info(
        f"dry run: {'OK' if plan.ok else 'would FAIL'}; torch.distributed not initialised, no GPU touched"
    )
    return 0 if plan.ok else 2
