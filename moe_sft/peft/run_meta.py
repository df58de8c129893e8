"""What a LoRA/DoRA checkpoint records about its adapters and its base (moe_sft_meta.json), and
the resume check against the recipe: the adapters must be the same, and so must the base they
were trained on (the checkpoint does not hold it)."""

from __future__ import annotations

from pathlib import Path

from moe_sft.config import ConfigError, PeftConfig
from moe_sft.conversion.mcore_io import base_identity

# The fields that define the adapters' shapes and placement: resuming with others cannot load.
SHAPE_FIELDS = ("method", "rank", "target_modules", "share_expert_factor", "train_router", "train_embeddings")
# The adapters' scale (alpha / rank): the checkpoint's B was trained under it, so another alpha
# would change the model's output at the resume step (refused, not rescaled).
RESUME_FIELDS = (*SHAPE_FIELDS, "alpha")


def record(cfg: PeftConfig, mcore_path: Path) -> dict:
    """The meta entries of a run (none for full-parameter SFT)."""
    if cfg.method == "none":
        return {}
    adapters = {f: getattr(cfg, f) for f in SHAPE_FIELDS} | {"alpha": cfg.alpha}
    adapters["target_modules"] = list(cfg.target_modules)
    return {"peft": adapters, "peft_base": {"path": str(Path(mcore_path).resolve()), "id": base_identity(mcore_path)}}


def check_resume(run_meta: dict, cfg: PeftConfig, mcore_path: Path, resume_path: Path) -> None:
    """ConfigError when the recipe cannot resume the run's checkpoint (before any model is built)."""
    saved = run_meta.get("peft")
    if saved is None and cfg.method == "none":
        return
    where = f"the run's checkpoint {resume_path}"
    if saved is None:
        raise ConfigError(
            f"peft.method={cfg.method}: {where} is a full-parameter SFT run; resume it with peft.method=none, "
            "or start the LoRA run in a new trainer.output_dir (model.mcore_path may point at that checkpoint)"
        )
    if cfg.method == "none":
        raise ConfigError(
            f"peft.method=none: {where} holds {saved['method']} adapters (not a full model); resume with "
            f"peft.method={saved['method']} and the same peft section, or export it (merged) and fine-tune that"
        )
    differ = [
        f"peft.{f}={getattr(cfg, f)!r} (checkpoint: {saved.get(f)!r})"
        for f in RESUME_FIELDS
        if (f in SHAPE_FIELDS or f in saved)
        and (list(getattr(cfg, f)) if f == "target_modules" else getattr(cfg, f)) != saved.get(f)
    ]
    if differ:
        raise ConfigError(
            f"{where} was trained with other adapters: {'; '.join(differ)}. Set these back to resume, or "
            "start a new run in a new trainer.output_dir"
        )
    base = run_meta.get("peft_base", {})
    if base.get("id") != base_identity(mcore_path):
        raise ConfigError(
            f"model.mcore_path={str(mcore_path)!r} is not the base {where} was trained on "
            f"({base.get('path')!r}); point model.mcore_path at it (the adapters alone are in the checkpoint)"
        )
