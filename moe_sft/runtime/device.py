"""Startup capability probe: which device, precision and layer backend, and why."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from moe_sft.runtime import cpu_compat, megatron_fixes


@dataclass(frozen=True)
class RuntimeChoice:
    device: str  # cuda | cpu
    precision: str  # bf16 | fp32
    backend: str  # te | torch
    reasons: tuple[str, ...]

    def describe(self) -> str:
        return (
            f"device={self.device} precision={self.precision} backend={self.backend} (" + "; ".join(self.reasons) + ")"
        )


TE_NOT_VALIDATED = "Transformer Engine spec: not validated by moe-sft's tests; the torch-native path is the tested one"


def _te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _te_importable() -> bool:
    if not _te_installed():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401

        return True
    except Exception:  # a broken TE install must not take the torch path down with it
        return False


def choose_runtime(device: str = "auto", precision: str = "auto", backend: str = "auto") -> RuntimeChoice:
    reasons = []
    has_cuda = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if has_cuda else "cpu"
        reasons.append("CUDA available" if has_cuda else "no CUDA device: CPU (gloo)")
    elif device == "cuda" and not has_cuda:
        raise RuntimeError("trainer.device=cuda but torch sees no CUDA device; use trainer.device=auto or cpu.")
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    if device == "cpu" and precision == "bf16":
        reasons.append("bf16 on CPU is slow; fp32 recommended")
    if backend == "auto":  # the tested path, even where TE imports: te is an explicit opt-in
        backend = "torch"
        reasons.append(
            "torch-native spec"
            + (" (transformer_engine is installed but unused: model.backend=te opts in)" if _te_installed() else "")
        )
    elif backend == "te":
        if device != "cuda" or not _te_importable():
            raise RuntimeError(
                "model.backend=te but transformer_engine does not import on this "
                "machine (or no CUDA); use model.backend=auto or torch."
            )
        reasons.append(TE_NOT_VALIDATED)
    return RuntimeChoice(device, precision, backend, tuple(reasons))


def prepare_runtime(choice: RuntimeChoice) -> list[str]:
    """Apply megatron-core's bug fixes (and the CPU emulation on CPU); returns what was applied (for
    the log). moe-sft's kernels are installed separately (moe_sft.kernels.install)."""
    applied = megatron_fixes.apply_megatron_fixes()
    if choice.device == "cpu":
        applied += cpu_compat.apply_cpu_compat()
    return applied


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor on `device`. To a GPU it goes through pinned memory without waiting: a copy
    from pageable memory makes the host wait until every kernel already queued has run, so the
    GPU runs dry at each micro-batch's inputs (benchmarks/benchmark.py's host-sync census)."""
    if t.device.type != "cpu" or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
