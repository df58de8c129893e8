"""The one place that installs moe-sft's kernels, behind `kernels.fused` (config/schema.py's KernelsConfig).

Global swaps of megatron-core functions are installed at startup by `install` (the trainer calls it
after runtime.device.prepare_runtime has applied megatron's bug fixes); the per-object ones by
`install_on_model` (after DDP wraps the chunks) and `install_on_optimizer` (after megatron builds
the optimizer). With `kernels.fused=false` megatron's own functions and the torch ops run
(tests/cpu/test_kernels_install.py: the same losses on CPU). Every swap is recorded in
runtime/patches.py under group "kernels", so switching off puts back exactly what was replaced.
"""

from __future__ import annotations

from moe_sft.runtime import patches


def _set_own_paths(fused: bool, wgrad_overlap: bool) -> None:
    from moe_sft.kernels import cross_entropy, rms_norm, wgrad

    cross_entropy.ENABLED = fused
    rms_norm.ENABLED = fused
    wgrad.ENABLED = fused
    wgrad.OVERLAP = wgrad_overlap


def install(cfg=None) -> list[str]:
    """Install (kernels.fused=true) or remove (false) the global swaps; returns the startup log lines.

    `cfg` is the `kernels` section (KernelsConfig; None: its defaults). Safe to call again with
    another setting."""
    if cfg is None:
        from moe_sft.config.schema import KernelsConfig

        cfg = KernelsConfig()
    patches.restore(patches.KERNELS)
    _set_own_paths(cfg.fused, cfg.wgrad_overlap)
    if not cfg.fused:
        return ["kernels.fused=false: megatron-core's own functions and torch ops (no moe-sft kernels)"]
    from megatron.core.transformer.moe import moe_utils

    from moe_sft.kernels import (
        frozen_linear,
        mtp_roll,
        one_rank_collectives,
        optimizer,
        permute,
        rope,
        router_gemm,
        router_topk,
    )

    lines = []
    if getattr(moe_utils, "te_general_gemm", None) is None:  # TE's GEMM is the bf16 one already
        router_gemm.use_bf16_router_gemms()
        lines.append("router fp32 logits from bf16 GEMMs on CUDA (as TE's), not fp32 GEMMs")
    router_topk.use_fused_routing()
    lines.append("router score function, top-k and routing map: one Triton pass each way on CUDA")
    permute.use_gather_permutation()
    lines.append(
        "token dispatchers: permute/unpermute by gathers, no atomic adds; dropless dispatch without host syncs"
    )
    one_rank_collectives.skip_one_rank_collectives()
    lines.append("TP/EP collectives over one rank: the input itself, without megatron's identity autograd Function")
    rope.use_sync_free_rope()
    lines.append("packed-sequence RoPE: no host syncs (CP 1); one Triton pass each way on CUDA")
    mtp_roll.use_sync_free_roll()
    lines.append("MTP packed-sequence roll: one gather (no host syncs; CP 1)")
    frozen_linear.use_2d_frozen_linear()
    lines.append("linears with a frozen weight (LoRA's base, the LM head): 2-D GEMMs, not one per token")
    if optimizer.use_foreach_grad_norm():
        lines.append("grad norm / clipping: torch foreach kernels (no apex/TE multi-tensor ops)")
    lines.append(
        "RMSNorm, cross entropy and expert weight gradients: Triton kernels on CUDA"
        + ("" if cfg.wgrad_overlap else " (expert weight gradients on the compute stream)")
    )
    return lines


def install_on_model(cfg, chunks, device: str) -> list[str]:
    """Per-model kernels on the DDP-wrapped `chunks`: the guard that makes megatron's bucket
    reductions wait for the experts' side-stream gradients, and the dense layers' weight-gradient
    fusion into the fp32 main grads. Returns the log lines."""
    from moe_sft.kernels import dense_wgrad, wgrad

    if not cfg.fused:
        return []
    if device == "cuda":
        wgrad.guard_grad_sync()
    fused = dense_wgrad.fuse_dense_wgrad(chunks, device)
    if not fused:
        return []
    return [
        f"{fused} dense layers add their weight gradients into the fp32 main grads inside the GEMM "
        "(megatron's gradient_accumulation_fusion, through torch.addmm), the input embedding's by row"
    ]


def install_on_optimizer(cfg, optimizer) -> list[str]:
    """torch's fused Adam, then clip + Adam in one Triton pass where it applies, on megatron's optimizer."""
    from moe_sft.kernels import optimizer as optimizer_kernels

    if not cfg.fused:
        return []
    lines = []
    if optimizer_kernels.use_fused_adam(optimizer):
        lines.append("optimizer: torch's fused Adam kernel (no TE/apex FusedAdam)")
    triton_adam: str | None = optimizer_kernels.use_triton_adam(optimizer)
    if triton_adam:
        lines.append(f"optimizer: {triton_adam}")
    return lines
