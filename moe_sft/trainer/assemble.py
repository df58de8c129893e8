"""Model assembly: the one place a training model is built (Megatron-Bridge's
`provide_distributed_model(pre_wrap_hook, post_wrap_hook)`, torchtitan's `parallelize_fn`).

`assemble` reads nothing but what it is given: the model's HF side read once (`HFModel.read`:
family, config, shape), the recipe, the run's `Layout` (moe_sft/config/layout.py) and runtime.
It checks the recipe against the model, builds the TransformerConfig and the GPTModel chunks
(models/builder.py), then applies named steps in order:

  pre-wrap   multi-token prediction, adapters, FP8 base, static rows, combine dtype,
             split dispatch, freezing
  wrap       megatron DDP, one per VPP chunk
  post-wrap  gradient-sync hooks, kernels on the model

Each step returns the startup log lines saying what it did; a step that cannot act says so instead
of claiming an option that is inert (kernels.fused=false leaves megatron's own dispatch and
combine in place, which read none of the flags set here). The trainer, the benchmark
(benchmarks/ours.py, through the trainer) and GPU tools call `assemble`; the offline converter's
single-rank model (conversion/single_rank.py) is the bare GPTModel that `assemble` starts from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig

from moe_sft.config import ConfigError, TrainConfig, format_errors, validate_against_model
from moe_sft.config.layout import Layout
from moe_sft.kernels import install as kernels
from moe_sft.kernels import permute
from moe_sft.layers import split_dispatch
from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config
from moe_sft.models.hf_config import num_experts
from moe_sft.peft import fp8_base, fp8_loading
from moe_sft.peft import install as peft_install
from moe_sft.peft import targets as peft_targets
from moe_sft.runtime.logs import get_logger
from moe_sft.trainer import freeze, overlap

log = get_logger(__name__)


@dataclass(frozen=True)
class HFModel:
    """A checkpoint's HF side, read once: its family, transformers config and shape."""

    family: Any
    config: Any
    shape: Any  # the family's ModelShape of `config`

    @classmethod
    def read(cls, hf_side: Path) -> HFModel:
        from moe_sft.conversion.hf_source import load_hf_config

        family, config = load_hf_config(hf_side)
        return cls(family, config, family.shape(config))


@dataclass
class Assembly:
    """What a step reads and changes; `assemble` returns it complete."""

    cfg: TrainConfig
    hf: HFModel
    layout: Layout
    device: str
    tconfig: Any
    chunks: list  # the GPTModel chunks (one per VPP stage), before the wrap
    model: list = field(default_factory=list)  # the DDP-wrapped chunks, after the wrap
    train_mtp: bool = False
    ddp_config: DistributedDataParallelConfig | None = None


Step = tuple[str, Callable[[Assembly], list[str]]]


def check_against_model(cfg: TrainConfig, hf: HFModel) -> None:
    """The recipe against the model's dimensions (before any weight is allocated)."""
    c, shape = hf.config, hf.shape
    validate_against_model(
        cfg,
        c.num_hidden_layers,
        num_experts(c) or None,
        c.num_attention_heads,
        # the shape's: Gemma 4's config refuses a global key/value head count (it varies per layer)
        shape.num_kv_heads,
        c.vocab_size,
        expert_biases=shape.linear_bias,
        topk=shape.topk,
        linear_key_heads=shape.linear_attention.key_heads if shape.linear_attention else 0,
    )
    if cfg.peft.method != "none":
        entries = list(cfg.peft.target_modules)
        errors = peft_targets.rank_errors(cfg.peft.rank, entries, shape)
        if errors:
            raise ConfigError(format_errors(errors))


# ----------------------------------------------------------------------------- pre-wrap steps


def multi_token_prediction(a: Assembly) -> list[str]:
    """MTP layers train with the recipe's loss weight, or stay frozen (before DDP sees them). A
    LoRA run trains adapters on the decoder only (as peft on transformers' model, which has no MTP
    layers): the MTP layers stay frozen and are not run."""
    depths = a.tconfig.mtp_num_layers or 0
    m = a.cfg.model
    adapted = a.cfg.peft.method != "none"
    a.train_mtp = bool(depths) and not m.freeze_mtp and m.mtp_loss_weight > 0 and not adapted
    if not depths:
        return []
    for chunk in a.chunks:
        chunk.run_mtp = a.train_mtp
        for param in chunk.mtp.parameters() if chunk.mtp_process and not a.train_mtp else ():
            param.requires_grad_(False)
    return [
        f"multi-token prediction: {depths} layer(s), "
        + (f"trained with loss weight {m.mtp_loss_weight}" if a.train_mtp else "frozen (exported unchanged)")
        + (" (a LoRA/DoRA run: adapters on the decoder only)" if adapted else "")
    ]


def adapters(a: Assembly) -> list[str]:
    if a.cfg.peft.method == "none":
        return []
    return list(peft_install.add_adapters(a.chunks, a.cfg.peft, a.tconfig, a.device))


def fp8_frozen_base(a: Assembly) -> list[str]:
    """The frozen base in FP8 (peft/fp8_base.py); the trainer's weight load fills it."""
    if a.cfg.peft.method == "none" or not a.cfg.peft.fp8_base:
        return []
    lines = list(fp8_base.install(a.chunks))
    fp8_loading.materialise_placeholders(a.chunks)
    return lines


def static_rows(chunks, layout: Layout, capacity: float) -> list[str]:
    """The allgather dispatchers' static row count (kernels/permute.py `enable_static_rows`); also
    re-applied when the benchmark changes the micro-batch length of a built model."""
    count = permute.enable_static_rows(chunks, layout.static_rows, capacity=capacity)
    return [f"{count} MoE layers permute a static row count per rank: no host wait in their dispatch"] if count else []


def combine_dtype(chunks, layout: Layout, dtype: str) -> list[str]:
    """model.moe_combine_dtype on the allgather dispatchers' combine (kernels/permute.py)."""
    if dtype == "fp32":
        return []
    if not layout.reduced_combine:
        if not layout.fused and layout.dispatcher == "allgather" and layout.expert_group > 1:
            return [f"model.moe_combine_dtype={dtype} is inactive: kernels.fused=false runs megatron's fp32 combine"]
        return []
    if permute.set_combine_dtype(chunks, dtype):
        return [f"the allgather's combine reduce-scatters in {dtype} (model.moe_combine_dtype; fp32 gives megatron's)"]
    return []


def dispatch_chunks(a: Assembly) -> list[str]:
    n = a.cfg.model.moe_dispatch_chunks
    if n <= 1:
        return []
    split, reasons = split_dispatch.enable(a.chunks, n, a.layout.expert_group)
    return [
        f"{split} MoE layers dispatch in {n} token chunks whose collectives overlap the experts "
        f"(model.moe_dispatch_chunks)" + (f"; not: {'; '.join(reasons)}" if reasons else "")
    ]


def freezing(a: Assembly) -> list[str]:
    m = a.cfg.model
    patterns = list(m.freeze_patterns) + ([freeze.ROUTER_PATTERN] if m.freeze_router else [])
    frozen, names = freeze.freeze(a.chunks, patterns, a.device)
    return [f"froze {patterns}: {len(names)} tensors, {frozen / 1e6:.2f}M parameters on rank 0"] if patterns else []


PRE_WRAP: tuple[Step, ...] = (
    ("multi-token prediction", multi_token_prediction),
    ("adapters", adapters),
    ("fp8 base", fp8_frozen_base),
    # after the adapters: experts with them are left out
    ("static rows", lambda a: static_rows(a.chunks, a.layout, a.cfg.model.moe_static_rows_capacity)),
    ("combine dtype", lambda a: combine_dtype(a.chunks, a.layout, a.cfg.model.moe_combine_dtype)),
    ("split dispatch", dispatch_chunks),
    ("freezing", freezing),
)


# ----------------------------------------------------------------------------- wrap and post-wrap


def wrap(a: Assembly) -> None:
    """megatron DDP per chunk. Only the first VPP chunk's buffers are bucketed (as Megatron-LM
    does): its grads are the last to be ready, so their reduction is what overlap can hide."""
    p = a.cfg.parallel
    a.ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
    )
    a.model = [
        DDP(config=a.tconfig, ddp_config=a.ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(a.chunks)
    ]


def grad_sync(a: Assembly) -> list[str]:
    overlap.install_sync_funcs(a.tconfig, a.model, a.ddp_config)
    return []


def model_kernels(a: Assembly) -> list[str]:
    return list(kernels.install_on_model(a.cfg.kernels, a.model, a.device))


POST_WRAP: tuple[Step, ...] = (
    ("gradient sync", grad_sync),
    ("kernels", model_kernels),
)


def assemble(
    cfg: TrainConfig,
    hf: HFModel,
    layout: Layout,
    *,
    precision: str,
    backend: str,
    device: str,
    pre_wrap: tuple[Step, ...] = PRE_WRAP,
    post_wrap: tuple[Step, ...] = POST_WRAP,
) -> Assembly:
    """The DDP-wrapped model chunks of a run, the steps applied in order, each logged."""
    check_against_model(cfg, hf)
    opts = ModelOptions.from_recipe(cfg.model, cfg.parallel, precision, backend, device)
    tconfig = build_transformer_config(hf.family, hf.config, opts)
    # an FP8 base is never whole in bf16: its weights are placeholders until loaded (peft/fp8_base.py)
    with fp8_loading.placeholder_base() if cfg.peft.fp8_base else contextlib.nullcontext():
        chunks = build_model_chunks(hf.family, hf.config, tconfig, opts)
    a = Assembly(cfg=cfg, hf=hf, layout=layout, device=device, tconfig=tconfig, chunks=chunks)
    _run(pre_wrap, a)
    wrap(a)
    _run(post_wrap, a)
    params = sum(x.numel() for c in chunks for x in c.parameters())
    log.info(
        f"model {hf.family.name}: {params / 1e6:.2f}M parameters on rank 0's shard, "
        f"{tconfig.num_layers} layers, {tconfig.num_moe_experts} experts"
    )
    return a


def _run(steps: tuple[Step, ...], a: Assembly) -> None:
    for _name, step in steps:
        for line in step(a):
            log.info(line)
