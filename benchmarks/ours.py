"""The moe-sft arm: the production Trainer (moe_sft/trainer/trainer.py), random weights, synthetic data.

The trainer is given two of its build phases and changes nothing of the step: the model source is
the preset's HF config written to a work directory (no checkpoint: megatron's random init, so
nothing is loaded and the checkpoint pre-flight is skipped), and the training batches are the
workload's packed batches. Everything else is the trainer's: TransformerConfig and GPTModel from
the family (torch-native spec: varlen attention, grouped_mm experts, alltoall dispatcher on
CUDA), megatron DDP, the distributed optimizer, and `Trainer.train_one_step` (schedule,
loss normalisation, guarded optimizer step, LR scheduler, telemetry) is what gets timed.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import phases
from benchmarks.workload import PRESETS, REPO, SyntheticPlan, Workload, hf_config
from moe_sft.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PeftConfig,
    TrainConfig,
    TrainerConfig,
)
from moe_sft.data.pipeline import DataPipeline
from moe_sft.plan import peft_memory
from moe_sft.runtime.patches import mcore_version
from moe_sft.trainer import loss_rows
from moe_sft.trainer import step as train_step
from moe_sft.trainer.trainer import ModelSource, Trainer


def bench_config(
    model: str,
    work: Path,
    *,
    ep: int,
    dispatcher: str = "auto",
    budget: int,
    micro_batches: int,
    max_steps: int,
    device: str = "auto",
    cuda_graphs: bool = False,
    peft: PeftConfig | None = None,
    static_rows_capacity: float = 2.0,
    combine_dtype: str = "bf16",
    dispatch_chunks: int = 1,
    attention_kernel: str = "auto",
) -> TrainConfig:
    """A TrainConfig as a recipe would give it (validated by the trainer before any process group)."""
    options = dict(PRESETS[model].model_options)
    return TrainConfig(
        model=ModelConfig(
            mcore_path=str(work / "model"),
            backend="torch",
            moe_token_dispatcher_type=dispatcher,
            moe_static_rows_capacity=static_rows_capacity,
            moe_combine_dtype=combine_dtype,
            moe_dispatch_chunks=dispatch_chunks,
            attention_kernel=attention_kernel,
            **options,
        ),
        # validate_config checks that a train file exists; the workload replaces the data plan
        data=DataConfig(
            train_files=[str(REPO / "recipes/demo/data/train.jsonl")],
            pack_length=budget,
            max_seq_len=budget,
            prefetch=False,
        ),
        parallel=ParallelConfig(expert_model_parallel_size=ep, use_distributed_optimizer=True),
        optimizer=OptimizerConfig(lr=1e-5, min_lr=1e-6, lr_warmup_steps=0, clip_grad=1.0),
        trainer=TrainerConfig(
            output_dir=str(work / "run"),
            max_steps=max_steps,
            global_batch_size=micro_batches,
            device=device,
            log_interval=10**9,
            export_hf_at_end=False,
            cuda_graphs=cuda_graphs,
        ),
        checkpoint=CheckpointConfig(save_at_end=False, resume="never"),
        peft=peft or PeftConfig(),
    )


# The LoRA arm: rank 16 (benchmark.py --lora-rank / --lora-alpha) on the attention and every routed
# expert, the base frozen (issue 28).
BENCH_LORA = PeftConfig(method="lora", rank=16, alpha=32, target_modules=["attention", "experts"])


def random_init_source(preset: str, layers: int, work: Path) -> ModelSource:
    """The preset's HF config in a directory of this rank's own (no rank waits for another's
    write), and no weights to load: megatron's random initialisation."""
    hf_side = work / "model" / f"hf.rank{os.environ.get('RANK', '0')}"
    hf_side.mkdir(parents=True, exist_ok=True)
    hf_config(preset, layers)[1].to_json_file(str(hf_side / "config.json"))
    return ModelSource(meta={}, hf_side=hf_side, resume_path=None, random_init=True)


class OursArm:
    def __init__(
        self,
        model: str,
        layers: int,
        work: Path,
        *,
        ep: int,
        dispatcher: str = "auto",
        first: Workload,
        max_steps: int,
        device: str = "auto",
        cuda_graphs: bool = False,
        lora: tuple[int, float] | None = None,
        lora_fp8_base: bool = False,
        static_rows_capacity: float = 2.0,
        combine_dtype: str = "bf16",
        dispatch_chunks: int = 1,
        attention_kernel: str = "auto",
    ):
        self.name = (
            "moe-sft"
            + ("-lora" if lora else "")
            + ("-fp8" if lora and lora_fp8_base else "")
            + ("-graphs" if cuda_graphs else "")
        )
        self.heads_over_loss_rows = loss_rows.ENABLED  # the hardware FLOPs (no CP here)
        cfg = bench_config(
            model,
            work,
            ep=ep,
            dispatcher=dispatcher,
            budget=first.budget,
            micro_batches=first.micro_batches,
            max_steps=max_steps,
            device=device,
            cuda_graphs=cuda_graphs,
            peft=dataclasses.replace(BENCH_LORA, rank=lora[0], alpha=lora[1], fp8_base=lora_fp8_base) if lora else None,
            static_rows_capacity=static_rows_capacity,
            combine_dtype=combine_dtype,
            dispatch_chunks=dispatch_chunks,
            attention_kernel=attention_kernel,
        )
        source = random_init_source(model, layers, work)
        data = DataPipeline(train=SyntheticPlan(first), eval=None, summary=[])
        self.peft_plan = peft_memory.from_config(cfg.peft)  # a LoRA arm's FLOP count (None: full SFT)
        self.trainer = Trainer(cfg, source=source, data=data).setup()
        t = self.trainer
        self.device, self.world, self.rank = t.rt.device, dist.get_world_size(), dist.get_rank()
        self.run_mtp = t.state.train_mtp
        self.step_index = 0  # the trainer's own step counter (LR schedule), over all budgets
        self._peak = (0.0, 0.0)
        self.last_metrics: dict = {}

    def use(self, workload: Workload) -> None:
        t = self.trainer
        t.state.batches = SyntheticPlan(workload)
        t.cfg.data.max_seq_len = workload.budget
        t.use_pack_length(workload.budget)  # shape, static rows and graphs for this budget

    def prepare(self, step: int) -> None:
        self.trainer.state.batches.global_batch(step)

    def step(self, step: int) -> float:
        t = self.trainer
        t.state.batches.next_step = step
        metrics = t.train_one_step(step)
        self.step_index += 1
        self.last_metrics = metrics
        if "memory/max_allocated_gib" in metrics:  # telemetry resets the peak every step: keep the max
            self._peak = (
                max(self._peak[0], metrics["memory/max_allocated_gib"]),
                max(self._peak[1], metrics["memory/max_reserved_gib"]),
            )
        return float(metrics["train/loss"])

    def install_scopes(self) -> phases.Scopes:
        t, scopes = self.trainer, phases.Scopes()
        for i, chunk in enumerate(t.state.model):
            scopes.modules(chunk.module, prefix="" if len(t.state.model) == 1 else f"chunk{i}")
        scopes.attribute(train_step, "_loss_func", "loss")  # looked up when each micro-batch's step is made
        scopes.attribute(t.state.tconfig, "finalize_model_grads_func", "grads")
        scopes.attribute(t.state.optimizer, "step", "optimizer")
        return scopes

    def fed(self) -> tuple[int, str]:
        return self.trainer.state.batches.fed_tokens, self.trainer.state.batches.fed_digest

    def reset_fed(self) -> None:
        self.trainer.state.batches.reset_record()

    def reset_peak(self) -> None:
        self._peak = (0.0, 0.0)
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_memory_gib(self) -> tuple[float, float]:
        return self._peak

    def describe(self) -> dict:
        t = self.trainer
        params = sum(p.numel() for c in t.state.model for p in c.parameters())
        static = sum(
            getattr(getattr(m, "token_dispatcher", None), "moe_sft_static_rows", False)
            for c in t.state.model
            for m in c.modules()
        )
        return dict(
            implementation="moe_sft Trainer.train_one_step (megatron-core "
            f"{mcore_version()}, torch-native spec, {t.state.tconfig.moe_token_dispatcher_type} dispatcher, "
            f"static rows in {static} MoE layers, distributed optimizer)",
            params_rank0=params,
            ep=t.cfg.parallel.expert_model_parallel_size,
            precision=t.rt.precision,
            attention=_attention_kernel(t.rt.device),
            mtp_trained=self.run_mtp,
            trained_params_rank0=sum(p.numel() for c in t.state.model for p in c.parameters() if p.requires_grad),
            peft=t.cfg.peft.method,
            fp8_base=t.cfg.peft.fp8_base,
        )

    def close(self) -> None:
        self.trainer.close()


def _attention_kernel(device: str) -> str:
    from moe_sft.layers.attention import attention_kernel_name

    return attention_kernel_name(device)
