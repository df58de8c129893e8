"""megatron's distributed optimizer and LR/WD scheduler from the recipe's optimizer section."""

from __future__ import annotations

from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from moe_sft.kernels import install as kernels
from moe_sft.trainer import checkpoint, freeze


def peak_lr(cfg) -> float:
    """optimizer.lr, or peft.lr for a LoRA/DoRA run that sets it (everything trained there is
    adapters, and the routers when peft.train_router)."""
    p = cfg.peft
    return p.lr if p.method != "none" and p.lr is not None else cfg.optimizer.lr


def build_optimizer(cfg, model, tconfig, rt) -> tuple:
    """(optimizer, scheduler, log lines) for the DDP-wrapped `model` chunks; wires the optimizer's
    loss scaling and gradient finalisation into `tconfig` for megatron's pipeline schedule."""
    o = cfg.optimizer
    lr = peak_lr(cfg)
    oc = MegatronOptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=rt.precision == "bf16",
        params_dtype=tconfig.params_dtype,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        optimizer_cpu_offload=o.optimizer_cpu_offload,
        # megatron's default fraction is 0.0: offload on, nothing moved (docs/planner.md)
        optimizer_offload_fraction=o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0,
    )
    patterns = list(o.no_weight_decay_patterns)
    overrides, excluded = freeze.weight_decay_overrides(oc, checkpoint.unwrap(model), patterns, rt.device)
    lines = []
    if patterns:
        lines.append(
            f"no weight decay on {excluded} parameter tensor(s) matching {patterns} on rank 0 (besides "
            "biases and 1-D parameters)"
        )
    optimizer = get_megatron_optimizer(oc, model, config_overrides=overrides)
    lines += kernels.install_on_optimizer(cfg.kernels, optimizer)
    if o.optimizer_cpu_offload:
        lines.append(
            f"optimizer CPU offload: {o.optimizer_offload_fraction:.0%} of this rank's fp32 optimizer "
            "shard (main params, Adam moments) is stepped on the CPU (megatron's HybridDeviceOptimizer)"
        )
    # megatron's scheduler needs warmup < decay steps; a short run may end inside warmup
    steps = max(cfg.trainer.max_steps, o.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.lr_warmup_steps else lr,
        max_lr=lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_steps,
        lr_decay_steps=steps,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )  # the recipe's schedule wins on resume
    tconfig.grad_scale_func = optimizer.scale_loss
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = [c.no_sync for c in model] if len(model) > 1 else model[0].no_sync
    return optimizer, scheduler, lines
