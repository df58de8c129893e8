"""Pre-flight checks that need the model shape or the file system, before any GPU work.

* layout: every check of moe_sft.config.validate (the same rules the trainer runs), plus the
  divisibility rules megatron asserts while building the model (FFN widths vs TP / ETP, MLA
  ranks vs TP); each message names the values and the fix.
* checkpoints: the converted checkpoint is complete and is the recipe's model; a resume pointer
  (`checkpoints/latest`) points at a complete step. The trainer runs `trainer_preflight` before it
  creates a process group.
"""

from __future__ import annotations

from pathlib import Path

from moe_sft.config.schema import ConfigError, format_errors
from moe_sft.config.validate import CHECKS, validate_against_model
from moe_sft.conversion import mcore_io

# Checks about files of the machine that runs the job: warnings when planning elsewhere.
ENVIRONMENT_CHECKS = ("data_files", "model_paths")


def _divisor_hint(n: int, limit: int = 64) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def layout_problems(
    cfg, world: int, shape, backend: str = "torch", strict: bool = False
) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a recipe at `world` ranks for the model `shape`; `strict`: missing
    data / checkpoint files are errors too (pre-flight on the cluster, not planning elsewhere)."""
    errors, warnings = [], []
    for name, check in CHECKS:
        target = warnings if name in ENVIRONMENT_CHECKS and not strict else errors
        target.extend(f"[{name}] {msg}" for msg in check(cfg, world))
    try:
        validate_against_model(
            cfg,
            shape.num_layers,
            shape.num_experts or None,
            shape.num_heads,
            shape.num_kv_heads,
            shape.vocab,
            expert_biases=shape.linear_bias,
            topk=shape.topk,
            linear_key_heads=shape.linear_attention.key_heads if shape.linear_attention else 0,
        )
    except ConfigError as err:
        errors.extend(line.strip()[2:] for line in str(err).splitlines()[1:])
    errors.extend(_width_errors(cfg, shape, backend))
    return errors, warnings


def _width_errors(cfg, shape, backend: str) -> list[str]:
    """megatron splits these widths evenly (ColumnParallelLinear's `divide` asserts)."""
    p = cfg.parallel
    tp = p.tensor_model_parallel_size
    etp = p.expert_tp
    widths = []
    if not all(shape.moe_layers):
        widths.append(("dense intermediate_size", shape.ffn, tp, "tensor_model_parallel_size"))
    if shape.shared_ffn:
        widths.append(("shared-expert intermediate size", shape.shared_ffn, tp, "tensor_model_parallel_size"))
    if shape.num_experts:
        widths.append(("moe_intermediate_size", shape.moe_ffn, etp, "expert_tensor_parallel_size (null = TP)"))
    # layers with their own key/value heads (Gemma 4's full layers: num_global_key_value_heads)
    for kv in sorted({a.num_kv_heads for a in shape.attention_layers} - {shape.num_kv_heads}):
        widths.append(
            ("key/value heads of some layers (num_global_key_value_heads)", kv, tp, "tensor_model_parallel_size")
        )
    if shape.mla and backend != "te":  # torch-native spec: the down projections are column-parallel
        if shape.mla.q_lora:
            widths.append(("q_lora_rank", shape.mla.q_lora, tp, "tensor_model_parallel_size"))
        widths.append(
            ("kv_lora_rank + qk_rope_head_dim", shape.mla.kv_lora + shape.mla.qk_rope, tp, "tensor_model_parallel_size")
        )
    return [
        f"[tensor_split] parallel.{field}={size} does not divide the {what}={width}; use one of {_divisor_hint(width)}"
        for what, width, size, field in widths
        if size > 0 and width % size
    ]


def schedule_warnings(cfg, lay) -> list[str]:
    micro = cfg.trainer.global_batch_size // max(lay.dp, 1)
    if lay.pp > 1 and micro < 4 * lay.pp:
        bubble = (lay.pp - 1) / (lay.vp * max(micro, 1))
        return [
            f"[pipeline_bubble] {micro} micro-batches per data-parallel rank for PP={lay.pp}: the pipeline "
            f"idles ~{bubble:.0%} of a step; raise trainer.global_batch_size to >= {4 * lay.pp * lay.dp}"
        ]
    return []


# ----------------------------------------------------------------------------- checkpoints


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"  # = moe_sft.trainer.checkpoint.step_dir (tested)


def resume_problems(cfg) -> list[str]:
    """A `latest` pointer that names a missing or incomplete step would restart silently."""
    if cfg.checkpoint.resume != "auto":
        return []
    root = Path(cfg.trainer.output_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        return []
    text = pointer.read_text().strip()
    if not text.isdigit():
        return [f"{pointer} holds {text!r}, not a step number; delete it to start fresh or write the step to resume"]
    step = _step_dir(root, int(text))
    problems = mcore_io.checkpoint_problems(step, field="resume checkpoint")
    if not step.is_dir():
        problems.append(
            f"{pointer} names step {int(text)} but {step} does not exist; restore it, point latest at "
            f"an existing step, or set checkpoint.resume=never to start from model.mcore_path"
        )
    return problems


def export_dir_problems(cfg) -> list[str]:
    """A user's files in `output_dir/hf` (or `hf_adapter`), which the end-of-run export replaces
    whole: named before training, not after it."""
    if not cfg.trainer.export_hf_at_end:
        return []
    out = Path(cfg.trainer.output_dir)
    dirs = [(out / mcore_io.HF_SUBDIR, "HF export", mcore_io.written_by_export(out / mcore_io.HF_SUBDIR))]
    if cfg.peft.method != "none":
        from moe_sft.peft.hf_adapter import ADAPTER_DIR, CONFIG_FILE, WEIGHTS_FILE

        dirs.append((out / ADAPTER_DIR, "PEFT adapter export", lambda name: name in (CONFIG_FILE, WEIGHTS_FILE)))
    return [
        mcore_io.user_entries_message(path, theirs, what)
        for path, what, ours in dirs
        if (theirs := mcore_io.user_entries(path, ours))
    ]


def checkpoint_problems(cfg) -> list[str]:
    m = cfg.model
    problems = []
    if m.mcore_path and not (m.create_tiny_if_missing and not Path(m.mcore_path).exists()):
        problems += mcore_io.checkpoint_problems(m.mcore_path)
    return problems + resume_problems(cfg) + export_dir_problems(cfg)


def model_match_problems(cfg) -> list[str]:
    """The converted checkpoint's HF config against model.hf_config (when the recipe names one)."""
    from moe_sft.plan.shapes import resolve_model

    if not cfg.model.hf_config:
        return []
    try:
        return resolve_model(cfg)[2]
    except ConfigError as err:
        return [str(err)]


def trainer_preflight(cfg) -> None:
    """Run by the trainer on every rank before any process group (they all read the same shared
    files, so they all stop): a broken or foreign checkpoint fails here, not after loading."""
    problems = checkpoint_problems(cfg) + model_match_problems(cfg)
    if problems:
        raise ConfigError(format_errors([f"[checkpoint] {p}" for p in problems]))
