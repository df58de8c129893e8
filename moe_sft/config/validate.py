"""Pre-flight cross-checks of a TrainConfig: run before any process group is created.

`validate_config(cfg, world_size)` needs no model; `validate_against_model(...)` needs the sizes
from the HF config. Both run every named check, collect ALL failures and raise one ConfigError
whose lines read "[check] field=value problem; fix".

The layout rules are megatron-core 0.16.1's (parallel_state.initialize_model_parallel,
TransformerConfig.__post_init__, schedules.forward_backward_pipelining_with_interleaving),
repeated here so they fail in seconds with a fix instead of minutes later with an assert.
"""

import dataclasses
import fnmatch
import importlib.util
import math
import os
from collections.abc import Callable

from moe_sft.config.layout import Layout
from moe_sft.config.peft_shorthands import patterns
from moe_sft.config.schema import SECTIONS, ConfigError, ParallelConfig, TrainConfig, format_errors

Check = Callable[[TrainConfig, int], list[str]]


# ----------------------------------------------------------------------------- derived sizes


def data_parallel_size(parallel: ParallelConfig, world_size: int) -> int | None:
    """dp = world / (tp*pp*cp); None when that is not an integer."""
    return Layout.of_parallel(parallel, world_size).exact_dp()


def expert_data_parallel_size(parallel: ParallelConfig, world_size: int) -> int | None:
    """Expert dp = world / (etp*ep*pp); None when that is not an integer."""
    return Layout.of_parallel(parallel, world_size).exact_edp()


def _divisors(n: int, limit: int = 0) -> list[int]:
    found = [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []
    return [d for d in found if d <= limit] if limit else found


def _fmt(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


# ----------------------------------------------------------------------------- checks (no model)


def check_choices(cfg: TrainConfig, world_size: int) -> list[str]:
    """Every field with metadata["choices"] holds one of them."""
    errors = []
    for section in SECTIONS:
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            choices = f.metadata.get("choices")
            value = getattr(obj, f.name)
            if choices is not None and value not in choices:
                allowed = " | ".join("null" if c is None else str(c) for c in choices)
                errors.append(f"{section}.{f.name}={value!r} is not one of {allowed}; use one of those")
    return errors


def check_parallel_sizes_positive(cfg: TrainConfig, world_size: int) -> list[str]:
    p = cfg.parallel
    errors = [] if world_size >= 1 else [f"world_size={world_size} must be >= 1 (torchrun --nproc_per_node)"]
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "context_parallel_size",
    ):
        if getattr(p, name) < 1:
            errors.append(f"parallel.{name}={getattr(p, name)} must be >= 1; use 1 to disable it")
    for name in (
        "virtual_pipeline_model_parallel_size",
        "expert_tensor_parallel_size",
        "num_layers_in_first_pipeline_stage",
        "num_layers_in_last_pipeline_stage",
    ):
        value = getattr(p, name)
        if value is not None and value < 1:
            errors.append(f"parallel.{name}={value} must be >= 1 or null")
    return errors


def check_model_parallel_divides_world(cfg: TrainConfig, world_size: int) -> list[str]:
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if min(tp, pp, cp, world_size) < 1 or data_parallel_size(p, world_size) is not None:
        return []
    return [
        f"parallel.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} x "
        f"context_parallel_size={cp} = {tp * pp * cp} does not divide world_size={world_size}; "
        f"choose sizes whose product is one of {_fmt(_divisors(world_size))} "
        f"or change --nproc_per_node"
    ]


def check_expert_layout(cfg: TrainConfig, world_size: int) -> list[str]:
    """megatron-core: world % (etp*ep*pp) == 0, the expert data-parallel size is integral.

    megatron 0.16.1 lays experts out on their own grid (etp, ep, expert-dp, pp) with cp=1, so the
    expert groups cut across the attention's TP, CP and DP ranks: etp*ep must divide
    world/pp = tp*cp*dp (with CP, expert DP = tp*cp*dp / (etp*ep)).
    """
    p, lay = cfg.parallel, Layout.of_parallel(cfg.parallel, world_size)
    etp, ep, pp, ranks = lay.etp, lay.ep, lay.pp, lay.expert_ranks
    if min(etp, ep, pp, world_size) < 1 or lay.exact_edp() is not None:
        return []
    per_stage = world_size // pp if world_size % pp == 0 else None
    fit = f"; etp*ep must divide world_size/pp={per_stage}" if per_stage else ""
    if per_stage and p.context_parallel_size > 1:
        fit += f" (= tensor x context_parallel_size={p.context_parallel_size} x data parallel)"
    return [
        f"parallel.expert_tensor_parallel_size={etp} (null = TP) x expert_model_parallel_size={ep} x "
        f"pipeline_model_parallel_size={pp} = {ranks} does not divide world_size={world_size}, "
        f"so the expert data-parallel size {world_size}/{ranks} is not an integer{fit}; "
        f"lower expert_model_parallel_size or expert_tensor_parallel_size"
    ]


def check_global_batch_size(cfg: TrainConfig, world_size: int) -> list[str]:
    gbs = cfg.trainer.global_batch_size
    if gbs < 1:
        return [f"trainer.global_batch_size={gbs} must be >= 1 (packed micro-batches per step)"]
    dp = data_parallel_size(cfg.parallel, world_size)
    if dp is None or gbs % dp == 0:
        return []
    lower, upper = max(dp, gbs // dp * dp), (gbs // dp + 1) * dp
    return [
        f"trainer.global_batch_size={gbs} is not divisible by the data-parallel size {dp} "
        f"(world_size={world_size} / (tp*pp*cp)); use a multiple of {dp}, e.g. {lower} or {upper}"
    ]


def check_sequence_parallel(cfg: TrainConfig, world_size: int) -> list[str]:
    """MoE with TP>1 needs sequence parallelism (megatron-core ModelParallelConfig warns; we require)."""
    p = cfg.parallel
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        return [
            f"parallel.sequence_parallel=False with tensor_model_parallel_size="
            f"{p.tensor_model_parallel_size}: MoE with TP>1 requires sequence parallelism; "
            f"set parallel.sequence_parallel=true"
        ]
    return []


def check_pipeline_options(cfg: TrainConfig, world_size: int) -> list[str]:
    """VPP and uneven first/last stages only make sense with PP>1; VPP also constrains micro-batches."""
    p, errors = cfg.parallel, []
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    if vpp is not None and pp <= 1:
        errors.append(
            f"parallel.virtual_pipeline_model_parallel_size={vpp} needs "
            f"pipeline_model_parallel_size>1 (it is {pp}); set it to null or raise PP"
        )
    for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        if getattr(p, name) is not None and pp <= 1:
            errors.append(
                f"parallel.{name}={getattr(p, name)} needs pipeline_model_parallel_size>1 (it is {pp}); set it to null"
            )
    dp = data_parallel_size(p, world_size)
    if vpp is not None and pp > 1 and dp:
        # Interleaved schedule: micro-batch groups of size pp (microbatch_group_size_per_vp_stage).
        micro = cfg.trainer.global_batch_size // dp
        if micro < pp or micro % pp:
            errors.append(
                f"trainer.global_batch_size={cfg.trainer.global_batch_size} gives {micro} "
                f"micro-batches per data-parallel rank; the interleaved (VPP) schedule needs "
                f"a multiple of pipeline_model_parallel_size={pp}; use global_batch_size="
                f"{dp * pp * max(1, math.ceil(micro / pp))}"
            )
    return errors


def doc_multiple_for(tensor_parallel: int, context_parallel: int, sequence_parallel: bool) -> int:
    """Per-document padding multiple: CP splits each document into 2*CP chunks, SP each share over TP."""
    if context_parallel <= 1:
        return 1
    return 2 * context_parallel * (tensor_parallel if sequence_parallel else 1)


def check_sequence_lengths(cfg: TrainConfig, world_size: int) -> list[str]:
    d, p, errors = cfg.data, cfg.parallel, []
    for name in ("max_seq_len", "pack_length"):
        if getattr(d, name) < 1:
            errors.append(f"data.{name}={getattr(d, name)} must be >= 1")
    if d.max_seq_len > d.pack_length:
        errors.append(
            f"data.max_seq_len={d.max_seq_len} > data.pack_length={d.pack_length}: a conversation "
            f"must fit in one packed micro-batch; lower max_seq_len or raise pack_length"
        )
    need = doc_multiple_for(p.tensor_model_parallel_size, p.context_parallel_size, p.sequence_parallel)
    if d.pad_documents_to is not None and (d.pad_documents_to < 1 or d.pad_documents_to % need):
        errors.append(
            f"data.pad_documents_to={d.pad_documents_to} must be a positive multiple of {need}, what "
            f"context_parallel_size={p.context_parallel_size} (x TP under sequence parallel) needs; "
            f"use {math.ceil(max(d.pad_documents_to, 1) / need) * need} or null"
        )
    # SP splits tokens over TP ranks. (CP's chunks: the loader pads each document, see above.)
    multiple = p.tensor_model_parallel_size if p.sequence_parallel else 1
    if multiple > 1 and d.pack_length >= 1 and d.pack_length % multiple:
        errors.append(
            f"data.pack_length={d.pack_length} must be a multiple of {multiple} "
            f"(tensor_model_parallel_size (sequence_parallel)); "
            f"use {math.ceil(d.pack_length / multiple) * multiple}"
        )
    return errors


def check_data_files(cfg: TrainConfig, world_size: int) -> list[str]:
    d, errors = cfg.data, []
    if not d.train_files:
        errors.append("data.train_files=[] is empty; list at least one .jsonl file")
    for name in ("train_files", "eval_files"):
        for path in getattr(d, name):
            if not os.path.exists(path):
                errors.append(
                    f"data.{name} entry {path!r} does not exist (cwd: {os.getcwd()}); fix the path or remove it"
                )
    if d.tokenizer_path is not None and not os.path.isdir(d.tokenizer_path):
        errors.append(
            f"data.tokenizer_path={d.tokenizer_path!r} is not a directory; "
            f"fix it or use null (the tokenizer saved with the converted checkpoint)"
        )
    if cfg.trainer.eval_interval > 0 and not d.eval_files and not d.eval_fraction > 0:
        errors.append(
            f"trainer.eval_interval={cfg.trainer.eval_interval} but data.eval_files is empty and "
            f"data.eval_fraction=0; list eval files, hold out a fraction or set trainer.eval_interval=0"
        )
    return errors


def check_data_options(cfg: TrainConfig, world_size: int) -> list[str]:
    """File kinds, mixture weights, held-out fraction, row fields, template file, worker counts."""
    from moe_sft.data.formats import CANONICAL_FIELDS, SUPPORTED_SUFFIXES

    d, errors = cfg.data, []
    for name in ("train_files", "eval_files"):
        for path in getattr(d, name):
            if not os.path.isdir(path) and os.path.splitext(path)[1] not in SUPPORTED_SUFFIXES:
                errors.append(
                    f"data.{name} entry {path!r} is not a {' / '.join(SUPPORTED_SUFFIXES)} file or an HF "
                    f"save_to_disk directory; convert it or remove it"
                )
    if d.train_weights and len(d.train_weights) != len(d.train_files):
        errors.append(
            f"data.train_weights has {len(d.train_weights)} entries for {len(d.train_files)} "
            f"data.train_files; give one weight per file or [] (1 each)"
        )
    if any(w < 0 for w in d.train_weights) or (d.train_weights and not any(w > 0 for w in d.train_weights)):
        errors.append(f"data.train_weights={list(d.train_weights)} must be >= 0 with at least one > 0")
    if not 0 <= d.eval_fraction < 1:
        errors.append(f"data.eval_fraction={d.eval_fraction} must be in [0, 1) (e.g. 0.01)")
    unknown = sorted(set(d.fields) - set(CANONICAL_FIELDS))
    if unknown:
        errors.append(f"data.fields has unknown keys {unknown}; rename only {', '.join(CANONICAL_FIELDS)}")
    if d.chat_template is not None and not os.path.isfile(d.chat_template):
        errors.append(f"data.chat_template={d.chat_template!r} is not a file; give a .jinja file or null")
    for name, low in (("pack_window", 1), ("num_workers", 0)):
        if getattr(d, name) < low:
            errors.append(f"data.{name}={getattr(d, name)} must be >= {low}")
    return errors


def check_optimizer(cfg: TrainConfig, world_size: int) -> list[str]:
    o, errors = cfg.optimizer, []
    if not o.lr > 0:
        errors.append(f"optimizer.lr={o.lr} must be > 0")
    if not 0 <= o.min_lr <= max(o.lr, 0):
        errors.append(f"optimizer.min_lr={o.min_lr} must be in [0, optimizer.lr={o.lr}]")
    if o.weight_decay < 0:
        errors.append(f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(o, name) < 1:
            errors.append(f"optimizer.{name}={getattr(o, name)} must be in [0, 1)")
    if not o.adam_eps > 0:
        errors.append(f"optimizer.adam_eps={o.adam_eps} must be > 0 (e.g. 1e-8)")
    if o.clip_grad < 0:
        errors.append(f"optimizer.clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)")
    if o.lr_warmup_steps < 0:  # warmup longer than a (short, overridden) run is allowed
        errors.append(f"optimizer.lr_warmup_steps={o.lr_warmup_steps} must be >= 0; use 0 for no warmup")
    if o.optimizer_cpu_offload and not cfg.parallel.use_distributed_optimizer:
        errors.append(
            "optimizer.optimizer_cpu_offload=True needs parallel.use_distributed_optimizer=true; "
            "enable it or turn the offload off"
        )
    if o.optimizer_cpu_offload:
        errors.extend(optimizer_offload_errors(cfg.trainer.device, cfg.trainer.precision))
    if cfg.trainer.offload_between_steps and not cfg.parallel.use_distributed_optimizer:
        errors.append(
            "trainer.offload_between_steps=true needs parallel.use_distributed_optimizer=true "
            "(megatron keeps the parameters in its offloadable buffers only then)"
        )
    if not 0 < o.optimizer_offload_fraction <= 1:
        errors.append(
            f"optimizer.optimizer_offload_fraction={o.optimizer_offload_fraction} must be in "
            "(0, 1]; turn the offload off with optimizer.optimizer_cpu_offload=false"
        )
    p = cfg.parallel
    if p.overlap_param_gather and not (p.use_distributed_optimizer and p.overlap_grad_reduce):
        errors.append(
            "parallel.overlap_param_gather=true needs parallel.use_distributed_optimizer=true "
            f"and parallel.overlap_grad_reduce=true (got {p.use_distributed_optimizer}, "
            f"{p.overlap_grad_reduce}); set both or turn the param-gather overlap off"
        )
    return errors


def cuda_graphs_ineligible(device: str, cfg: TrainConfig) -> list[str]:
    """Why `trainer.cuda_graphs` cannot be used with this run's layout (empty: it can)."""
    parallel, model, reasons = cfg.parallel, cfg.model, []
    if device != "cuda":
        reasons.append(f"trainer.device={device}: CUDA graphs need CUDA")
    for name in ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size"):
        if getattr(parallel, name) != 1:
            reasons.append(
                f"parallel.{name}={getattr(parallel, name)}: the graphed MoE half needs 1 (its "
                "dispatch then has fixed sizes and no host sync; PP > 1 keeps several micro-batches "
                "in flight, whose activations would share the graph's buffers)"
            )
    if parallel.expert_model_parallel_size > 1 and model.moe_token_dispatcher_type == "alltoall":
        # The allgather's collectives have static sizes, and with static rows so does its local
        # permutation (kernels/permute.py); the alltoall needs its split sizes on the host per layer.
        reasons.append(
            f"parallel.expert_model_parallel_size={parallel.expert_model_parallel_size} with "
            "model.moe_token_dispatcher_type=alltoall: its split sizes need the host in every MoE layer; "
            "use allgather or auto"
        )
    if parallel.expert_tp != 1:
        reasons.append(
            f"parallel.expert_tensor_parallel_size={parallel.expert_tensor_parallel_size} (null = TP): needs 1"
        )
    if parallel.overlap_grad_reduce or parallel.overlap_param_gather:
        # The graphed weights whose gradient goes into main_grad inside the graph never reach
        # autograd's accumulator, so DDP's hook never marks their bucket ready; without overlap
        # the buckets are reduced after the backward regardless.
        reasons.append(
            "parallel.overlap_grad_reduce / overlap_param_gather=true: DDP's per-parameter hooks do "
            "not run for the weights inside a graph"
        )
    if model.recompute_granularity:
        reasons.append(
            f"model.recompute_granularity={model.recompute_granularity}: recompute re-runs the "
            "forward inside the backward; use one or the other"
        )
    if model.activation_offload_modules:
        reasons.append("model.activation_offload_modules is set: offload moves activations the graph owns")
    if cfg.trainer.offload_between_steps:
        reasons.append(
            "trainer.offload_between_steps=true: moving the weights and grads moves what the graphs read and write"
        )
    return reasons


def check_trainer(cfg: TrainConfig, world_size: int) -> list[str]:
    t, c, errors = cfg.trainer, cfg.checkpoint, []
    if t.max_steps < 1:
        errors.append(f"trainer.max_steps={t.max_steps} must be > 0")
    if t.log_interval < 1:
        errors.append(f"trainer.log_interval={t.log_interval} must be >= 1")
    if t.peak_tflops < 0:
        errors.append(f"trainer.peak_tflops={t.peak_tflops} must be >= 0 (0 = from the GPU name)")
    for name, value in (("trainer.eval_interval", t.eval_interval), ("checkpoint.save_interval", c.save_interval)):
        if value < 0:
            errors.append(f"{name}={value} must be >= 0 (0 = off / only at the end)")
    if t.max_skipped_steps_in_a_row < 1:
        errors.append(f"trainer.max_skipped_steps_in_a_row={t.max_skipped_steps_in_a_row} must be >= 1")
    if c.keep_last < 1:
        errors.append(f"checkpoint.keep_last={c.keep_last} must be >= 1")
    for name, value in (("trainer.seed", t.seed), ("data.seed", cfg.data.seed)):
        if not 0 <= value < 2**32:
            errors.append(f"{name}={value} must be in [0, 2**32)")
    if not t.output_dir:
        errors.append("trainer.output_dir is empty; set a run directory")
    if t.cuda_graphs:
        device = "cpu" if t.device == "cpu" else "cuda"  # auto: checked again once the device is known
        errors += [
            f"trainer.cuda_graphs=true: {why}; or set trainer.cuda_graphs=false"
            for why in cuda_graphs_ineligible(device, cfg)
        ]
    return errors


def check_model(cfg: TrainConfig, world_size: int) -> list[str]:
    m, errors = cfg.model, []
    if m.backend == "te" and cfg.trainer.device == "cpu":
        errors.append("model.backend='te' needs CUDA but trainer.device='cpu'; use model.backend=torch or auto")
    for name in ("attention_dropout", "hidden_dropout"):
        if not 0 <= getattr(m, name) < 1:
            errors.append(f"model.{name}={getattr(m, name)} must be in [0, 1)")
    if m.attention_dropout > 0 and m.backend != "te":
        errors.append(
            f"model.attention_dropout={m.attention_dropout}: the torch-native attention has no dropout; "
            "set model.attention_dropout=0.0 (the SFT default) or model.backend=te"
        )
    if m.moe_aux_loss_coeff is not None and m.moe_aux_loss_coeff < 0:
        errors.append(f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} must be >= 0 or null")
    if m.moe_router_bias_update_rate is not None and m.moe_router_bias_update_rate < 0:
        errors.append(f"model.moe_router_bias_update_rate={m.moe_router_bias_update_rate} must be >= 0 or null")
    if m.mtp_loss_weight < 0:
        errors.append(f"model.mtp_loss_weight={m.mtp_loss_weight} must be >= 0 (0 = MTP layers not run)")
    if m.moe_expert_capacity_factor is not None:
        if m.moe_expert_capacity_factor <= 0:
            errors.append(
                f"model.moe_expert_capacity_factor={m.moe_expert_capacity_factor} must be > 0, or null for dropless"
            )
        if m.moe_router_load_balancing_type == "sinkhorn":
            errors.append(
                "model.moe_expert_capacity_factor is set with moe_router_load_balancing_type="
                "'sinkhorn'; megatron-core allows capacity only with aux_loss, seq_aux_loss, "
                "global_aux_loss or none"
            )
    if m.moe_static_rows_capacity < 1:
        errors.append(
            f"model.moe_static_rows_capacity={m.moe_static_rows_capacity} must be >= 1 (a multiple of a "
            "rank's expected routed rows); 2 is the default"
        )
    if m.moe_dispatch_chunks < 1 or m.moe_dispatch_chunks > cfg.data.pack_length:
        errors.append(
            f"model.moe_dispatch_chunks={m.moe_dispatch_chunks} must be between 1 (off) and "
            f"data.pack_length={cfg.data.pack_length}; 2 overlaps half a micro-batch's collectives"
        )
    errors.extend(_recompute_errors(cfg))
    errors.extend(_activation_offload_errors(cfg))
    return errors


def check_peft(cfg: TrainConfig, world_size: int) -> list[str]:
    """LoRA/DoRA options (moe_sft/peft/); the model-dependent checks (targets, rank vs dims) run
    once the model's shape is known, still before any weight is loaded."""
    p, errors = cfg.peft, []
    if p.method == "none":
        return []
    if p.rank < 1:
        errors.append(f"peft.rank={p.rank} must be >= 1 (typical: 8-64)")
    if p.alpha <= 0:
        errors.append(f"peft.alpha={p.alpha} must be > 0 (the update is alpha/rank * B @ A; typical: 2 x rank)")
    if not 0 <= p.dropout < 1:
        errors.append(f"peft.dropout={p.dropout} must be in [0, 1)")
    if p.method == "dora" and p.dropout > 0:
        errors.append(
            f"peft.dropout={p.dropout} with peft.method=dora: DoRA's magnitude then rescales a base output computed "
            "on the dropped-out input, which needs a second base GEMM per layer; set peft.dropout=0 or use lora"
        )
    if not p.target_modules:
        errors.append("peft.target_modules is empty; name the adapted modules, e.g. [attention, experts]")
    if p.lr is not None and p.lr <= 0:
        errors.append(f"peft.lr={p.lr} must be > 0, or null for optimizer.lr")
    if _te_backend(cfg.model.backend):
        errors.append(
            "peft.method with model.backend=te is not supported: the adapters sit beside the torch-native "
            "spec's linears and grouped experts; use model.backend=torch (the default, tested path)"
        )
    if p.share_expert_factor != "none" and cfg.parallel.expert_tp > 1:
        errors.append(
            f"peft.share_expert_factor={p.share_expert_factor!r} needs expert tensor parallel 1 (a factor shared by "
            f"the experts is reduced over TP and DP, which expert TP={cfg.parallel.expert_tp} splits differently); "
            "set parallel.expert_tensor_parallel_size=1 or peft.share_expert_factor=none"
        )
    return errors


def check_peft_fp8_base(cfg: TrainConfig, world_size: int) -> list[str]:
    """peft.fp8_base keeps a frozen base in FP8 (moe_sft/peft/fp8_base.py): only under LoRA."""
    p = cfg.peft
    if not p.fp8_base:
        return []
    if p.method == "none":
        return [
            "peft.fp8_base=true needs peft.method=lora: only a frozen base can be held in FP8 "
            "(full-parameter SFT trains every weight in bf16); set peft.method=lora or peft.fp8_base=false"
        ]
    if p.method == "dora":
        return [
            "peft.fp8_base=true with peft.method=dora is not supported: DoRA rescales by the norms of the "
            "base weight's rows, which an FP8 base would dequantise in full every step; use peft.method=lora "
            "or peft.fp8_base=false"
        ]
    return []


RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "layernorm", "mla_up_proj", "shared_experts")
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")


def optimizer_offload_errors(device: str, precision: str) -> list[str]:
    """Optimizer CPU offload on this device/precision ('auto' passes; the trainer re-checks the
    resolved values). megatron's hybrid optimizer splits GPU tensors from CPU ones and steps the
    fp32 main-param shards, which exist as separate tensors only for bf16 weights."""
    errors = []
    if device == "cpu":
        errors.append(
            "optimizer.optimizer_cpu_offload moves optimizer state from the GPU to the CPU; "
            "with trainer.device=cpu turn it off"
        )
    if precision == "fp32":
        errors.append(
            "optimizer.optimizer_cpu_offload needs trainer.precision=bf16 (with fp32 weights "
            "megatron's distributed optimizer hands the hybrid optimizer views of the model "
            "parameters, which torch optimizers refuse); use bf16 or turn the offload off"
        )
    return errors


def _te_backend(backend: str) -> bool:
    return backend == "te"  # auto is the torch-native spec, even where Transformer Engine imports


def _activation_offload_errors(cfg: TrainConfig) -> list[str]:
    m, errors = cfg.model, []
    unknown = sorted(set(m.activation_offload_modules) - set(OFFLOAD_MODULES))
    if unknown:
        errors.append(f"model.activation_offload_modules has {unknown}; choose from {list(OFFLOAD_MODULES)}")
    if m.activation_offload_modules and not _te_backend(m.backend):
        errors.append(
            f"model.activation_offload_modules={list(m.activation_offload_modules)} needs Transformer "
            f"Engine (megatron-core 0.16.1 offloads through TE's CPU offload; measured: 'TE CPU "
            f"offload is not available' with model.backend={m.backend!r}); use recompute "
            "instead (model.recompute_granularity) or install TE"
        )
    if m.activation_offload_modules and cfg.trainer.device == "cpu":
        errors.append(
            "model.activation_offload_modules moves activations from the GPU to the CPU; with "
            "trainer.device=cpu set it to []"
        )
    if "attn_proj" in m.activation_offload_modules and "core_attn" not in m.activation_offload_modules:
        errors.append(
            "model.activation_offload_modules: attn_proj needs core_attn too (attn_proj's input "
            "is core_attn's output, which core_attn's backward needs)"
        )
    if (
        "moe_act" in m.activation_offload_modules
        and m.recompute_granularity == "selective"
        and "moe_act" in (m.recompute_modules or [])
    ):
        errors.append("model: moe_act is both recomputed and offloaded; choose one")
    return errors


def _recompute_errors(cfg: TrainConfig) -> list[str]:
    """megatron-core: full needs recompute_method and recompute_num_layers; selective forbids the count."""
    m = cfg.model
    if m.recompute_granularity == "full" and (m.recompute_method is None or m.recompute_num_layers is None):
        return [
            f"model.recompute_granularity='full' needs recompute_method (uniform|block) and "
            f"recompute_num_layers (got {m.recompute_method!r}, {m.recompute_num_layers!r}); "
            f"e.g. model.recompute_method=uniform model.recompute_num_layers=1"
        ]
    if m.recompute_granularity == "selective" and m.recompute_num_layers is not None:
        return [
            f"model.recompute_num_layers={m.recompute_num_layers} must be null with recompute_granularity='selective'"
        ]
    if m.recompute_num_layers is not None and m.recompute_num_layers < 1:
        return [f"model.recompute_num_layers={m.recompute_num_layers} must be >= 1"]
    if m.recompute_modules is not None:
        if m.recompute_granularity != "selective":
            return [
                f"model.recompute_modules={m.recompute_modules} needs "
                f"model.recompute_granularity=selective (got {m.recompute_granularity!r})"
            ]
        unknown = sorted(set(m.recompute_modules) - set(RECOMPUTE_MODULES))
        if unknown:
            return [f"model.recompute_modules has {unknown}; choose from {list(RECOMPUTE_MODULES)}"]
    return []


def check_model_paths(cfg: TrainConfig, world_size: int) -> list[str]:
    """What the machine that runs the job must hold: the checkpoint, and Transformer Engine for
    model.backend=te (planning elsewhere makes these warnings: plan/preflight.py)."""
    return _model_path_errors(cfg) + _backend_install_errors(cfg)


def _backend_install_errors(cfg: TrainConfig) -> list[str]:
    if cfg.model.backend != "te" or cfg.trainer.device == "cpu":  # te on CPU: check_model says so
        return []
    if importlib.util.find_spec("transformer_engine") is not None:
        return []
    return [
        "model.backend='te' but transformer_engine is not installed in this Python environment; install "
        "Transformer Engine for your CUDA and torch (pip install transformer_engine[pytorch]) or use "
        "model.backend=torch (the default, tested path)"
    ]


def _model_path_errors(cfg: TrainConfig) -> list[str]:
    m = cfg.model
    if m.create_tiny_if_missing:
        missing = [n for n in ("hf_path", "mcore_path") if getattr(m, n) is None]
        return [f"model.create_tiny_if_missing=True needs model.{n} (where the tiny model is written)" for n in missing]
    if m.mcore_path is None:
        return [
            "model.mcore_path is null; set it to a checkpoint converted with "
            "tools/convert_hf_to_mcore.py (or model.create_tiny_if_missing=true for the quickstart)"
        ]
    if not os.path.isdir(m.mcore_path):
        return [
            f"model.mcore_path={m.mcore_path!r} does not exist; convert the HF checkpoint "
            f"(model.hf_path={m.hf_path!r}) with tools/convert_hf_to_mcore.py first, or fix the path"
        ]
    return []


CHECKS: tuple[tuple[str, Check], ...] = (
    ("choices", check_choices),
    ("parallel_sizes_positive", check_parallel_sizes_positive),
    ("model_parallel_divides_world", check_model_parallel_divides_world),
    ("expert_layout", check_expert_layout),
    ("global_batch_size", check_global_batch_size),
    ("sequence_parallel", check_sequence_parallel),
    ("pipeline_options", check_pipeline_options),
    ("sequence_lengths", check_sequence_lengths),
    ("data_files", check_data_files),
    ("data_options", check_data_options),
    ("optimizer", check_optimizer),
    ("trainer", check_trainer),
    ("model", check_model),
    ("peft", check_peft),
    ("peft_fp8_base", check_peft_fp8_base),
    ("model_paths", check_model_paths),
)


def resolve_global_batch(cfg: TrainConfig, world_size: int) -> str | None:
    """trainer.global_batch_tokens -> trainer.global_batch_size (in place); a line saying how."""
    t, p = cfg.trainer, cfg.parallel
    dp = data_parallel_size(p, world_size)
    if t.global_batch_tokens is None or not dp or cfg.data.pack_length < 1:
        return None
    if t.global_batch_tokens < 1:
        raise ConfigError(f"trainer.global_batch_tokens={t.global_batch_tokens} must be >= 1 (or null)")
    unit = dp * (p.pipeline_model_parallel_size if p.virtual_pipeline_model_parallel_size else 1)
    t.global_batch_size = math.ceil(t.global_batch_tokens / cfg.data.pack_length / unit) * unit
    return (
        f"global batch: {t.global_batch_tokens:,} tokens -> global_batch_size={t.global_batch_size} micro-batches "
        f"of data.pack_length={cfg.data.pack_length} (a multiple of {unit}) = "
        f"{t.global_batch_size * cfg.data.pack_length:,} token slots per step"
    )


def validate_config(cfg: TrainConfig, world_size: int) -> None:
    """Resolve trainer.global_batch_tokens, run every named check; raise one ConfigError listing
    all failures."""
    resolve_global_batch(cfg, world_size)
    errors = [f"[{name}] {msg}" for name, check in CHECKS for msg in check(cfg, world_size)]
    if errors:
        raise ConfigError(format_errors(errors))


# ----------------------------------------------------------------------------- checks (need the model)


def validate_against_model(
    cfg: TrainConfig,
    num_layers: int,
    num_experts: int | None,
    num_attention_heads: int,
    num_query_groups: int | None,
    vocab_size: int,
    expert_biases: bool = False,
    topk: int = 0,
    linear_key_heads: int = 0,
) -> None:
    """Checks that need the HF config's sizes; raise one ConfigError listing all failures.

    num_query_groups=None means plain multi-head attention (= num_attention_heads);
    num_experts=None means a dense model (no expert checks); expert_biases: the experts' GEMMs
    have biases (gpt-oss); topk: experts per token; linear_key_heads: the Gated DeltaNet layers'
    key heads (Qwen3-Next, Qwen3.5; 0: no such layers).
    """
    p = cfg.parallel
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    groups = num_attention_heads if num_query_groups is None else num_query_groups
    errors = [f"[pipeline_layers] {m}" for m in _pipeline_layer_errors(p, num_layers)]
    if num_experts is not None and num_experts % ep:
        errors.append(
            f"[experts] parallel.expert_model_parallel_size={ep} does not divide "
            f"num_experts={num_experts}; use one of {_fmt(_divisors(num_experts, 256))}"
        )
    if num_experts is not None and expert_biases and p.expert_tp > 1:
        errors.append(
            f"[expert_biases] expert tensor parallel size {p.expert_tp} (parallel.expert_tensor_parallel_size, "
            "null = TP): this model's experts have biases, which megatron-core 0.16.1 supports only at "
            "expert TP 1; set parallel.expert_tensor_parallel_size=1 (TP still splits the attention)"
        )
    for name, count in (("num_attention_heads", num_attention_heads), ("num_query_groups", groups)):
        if count % tp:
            errors.append(
                f"[attention_heads] parallel.tensor_model_parallel_size={tp} does not divide "
                f"{name}={count}; use one of {_fmt(_divisors(math.gcd(num_attention_heads, groups)))}"
            )
    if vocab_size % tp:
        errors.append(
            f"[vocab] parallel.tensor_model_parallel_size={tp} does not divide vocab_size="
            f"{vocab_size} (the embedding is split evenly over TP); use one of "
            f"{_fmt(_divisors(math.gcd(vocab_size, num_attention_heads, groups)))}"
        )
    cp = p.context_parallel_size
    if linear_key_heads and linear_key_heads % (tp * cp):
        # TP splits the heads; CP's all-to-all gives each CP rank whole documents for 1/cp of a TP
        # rank's key heads and the value heads they serve (moe_sft/layers/context_parallel.py)
        errors.append(
            f"[linear_attention] parallel.tensor_model_parallel_size={tp} x parallel.context_parallel_size={cp} "
            f"does not divide linear_num_key_heads={linear_key_heads} (the Gated DeltaNet layers split their "
            f"key heads over TP, then over CP); use TP x CP in {_fmt(_divisors(linear_key_heads))}"
        )
    if cfg.trainer.cuda_graphs and num_experts and ep > 1 and topk:
        errors += [f"[cuda_graphs] {m}" for m in _graphed_dispatch_errors(cfg, num_experts, topk, expert_biases)]
    if errors:
        raise ConfigError(format_errors(errors))


def _graphed_dispatch_errors(cfg: TrainConfig, num_experts: int, topk: int, expert_biases: bool) -> list[str]:
    """trainer.cuda_graphs at EP > 1 captures the allgather's static-row permutation
    (moe_sft/kernels/permute.py): the alltoall the auto dispatcher picks past top-k ranks, and
    expert biases, rule it out."""
    errors = []
    lay = Layout.from_config(cfg, 0, topk=topk, device="cuda")  # graphs run on CUDA
    group = lay.expert_group
    if cfg.model.moe_token_dispatcher_type == "auto" and lay.dispatcher == "alltoall":
        errors.append(
            f"trainer.cuda_graphs=true with an expert group of EP x expert-TP = {group} > top-k {topk}: "
            "model.moe_token_dispatcher_type=auto picks the alltoall there, whose split sizes need the "
            "host in every MoE layer; set model.moe_token_dispatcher_type=allgather (it gathers every "
            "rank's tokens) or trainer.cuda_graphs=false"
        )
    if expert_biases:
        errors.append(
            "trainer.cuda_graphs=true with parallel.expert_model_parallel_size>1: this model's experts "
            "have biases, which read every row of the static-row permutation; set trainer.cuda_graphs=false"
        )
    if cfg.peft.method != "none" and _targets_routed_experts(cfg.peft.target_modules):
        errors.append(
            "trainer.cuda_graphs=true with parallel.expert_model_parallel_size>1: adapters on the routed "
            "experts read every row of the static-row permutation; leave 'experts' out of "
            "peft.target_modules, or set parallel.expert_model_parallel_size=1 or trainer.cuda_graphs=false"
        )
    return errors


def _targets_routed_experts(entries) -> bool:
    experts = "decoder.layers.0.mlp.experts"  # the grouped experts' module name (peft/targets.py)
    return any(fnmatch.fnmatchcase(experts, p) for entry in entries for p in patterns(entry))


def _pipeline_layer_errors(p: ParallelConfig, num_layers: int) -> list[str]:
    """megatron-core TransformerConfig: even split, or uneven first/last stages + even middle."""
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    if pp < 1 or num_layers < 1:
        return [] if num_layers >= 1 else [f"num_layers={num_layers} must be >= 1"]
    if first is None and last is None:
        if num_layers % pp:
            return [
                f"parallel.pipeline_model_parallel_size={pp} does not divide num_layers={num_layers}; "
                f"use one of {_fmt(_divisors(num_layers, 64))}, or set an uneven split"
                f"{_uneven_suggestion(num_layers, pp, vpp)}"
            ]
        if (num_layers // pp) % vpp:
            return [
                f"parallel.virtual_pipeline_model_parallel_size={vpp} does not divide the "
                f"{num_layers // pp} layers per pipeline stage (num_layers={num_layers} / pp={pp}); "
                f"use one of {_fmt(_divisors(num_layers // pp))} or null"
            ]
        return []
    errors = []
    for name, value in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if value is not None and value % vpp:
            errors.append(f"parallel.{name}={value} is not divisible by virtual_pipeline_model_parallel_size={vpp}")
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    if (
        middle_layers < 0
        or bool(middle_layers) != bool(middle_stages)
        or (middle_stages and middle_layers % (middle_stages * vpp))
    ):
        errors.append(
            f"parallel.num_layers_in_first_pipeline_stage={first} / num_layers_in_last_pipeline_stage="
            f"{last} leave {middle_layers} of num_layers={num_layers} for {middle_stages} middle "
            f"stage(s) (pipeline_model_parallel_size={pp}), which must split evenly"
            f"{' (and by VPP)' if vpp > 1 else ''}{_uneven_suggestion(num_layers, pp, vpp)}"
        )
    return errors


def _uneven_suggestion(num_layers: int, pp: int, vpp: int) -> str:
    """A last-stage size leaving an even split for the other pp-1 stages, nearest num_layers/pp."""
    if pp < 2:
        return ""
    target = num_layers / pp
    candidates = [last for last in range(vpp, num_layers, vpp) if (num_layers - last) % ((pp - 1) * vpp) == 0]
    if not candidates:
        return ""
    best = min(candidates, key=lambda last: abs(last - target))
    per_other = (num_layers - best) // (pp - 1)
    return f", e.g. parallel.num_layers_in_last_pipeline_stage={best} ({per_other} per other stage)"
