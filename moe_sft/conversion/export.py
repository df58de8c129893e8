"""moe-sft dist checkpoint → HF directory (sharded safetensors, index, config, tokenizer), streaming.

The model is never gathered: the megatron model exists on the meta device only (export_plan.py
says which checkpoint boxes make each parameter), each parameter is read from the torch_dist
checkpoint a unit at a time (a run of experts' blocks or of rows up to `read_bytes`, or the whole
of a tensor no transform can cut, dcp_reader.py), turned into its HF tensors by the family's
transform, and each HF tensor is written straight into its place in its safetensors shard
(hf_writer.py). Every unit is read into one buffer, allocated once, so peak memory is the imports
plus the largest unit and the HF tensors made from it, whatever the model size and however the
checkpoint is chunked. docs/conversion_at_scale.md
("Export") has the measurements.

A LoRA/DoRA run's checkpoint (adapters only, adapter_merge.py) exports merged: the plan and
the units come from its base (meta `peft_base`), each adapted unit is merged in fp32 with the
adapters read from the run's checkpoint, and tensors the run trained itself (routers) are read
from there.

Before anything is written, the checkpoint (and a LoRA run's base) is checked whole and unchanged
(checksums.py: the files `.metadata` lists, and `checksums.json` where the save recorded one), and
`--output` may not be, contain or lie inside a checkpoint it reads (`--overwrite` would delete it).
A full disk removes the partial export (DiskFullError, exit 4).

`load_model_from_checkpoint` (the whole single-rank model, for --verify and tests) lives here too.
"""

from __future__ import annotations

import dataclasses
import errno
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig

from moe_sft.conversion import adapter_merge, checksums, composite, export_plan, hf_writer, mcore_io
from moe_sft.conversion.dcp_reader import DistCheckpointReader
from moe_sft.conversion.export_plan import ParamPlan
from moe_sft.conversion.hf_reader import CheckpointError
from moe_sft.conversion.hf_source import load_hf_config, load_hf_source
from moe_sft.conversion.hf_writer import StreamingSafetensorsWriter
from moe_sft.conversion.meta_model import View
from moe_sft.conversion.single_rank import single_rank_model
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ExportError(CheckpointError):
    """The export did not run or did not finish; the message names the file and the fix.
    `exit_code` is the exit status of the tools and the trainer (2: unusable input)."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class DiskFullError(ExportError):
    exit_code = 4  # = moe_sft.train's "disk full"


def load_model_from_checkpoint(ckpt_dir: str | Path, precision: str = "fp32"):
    """Load any moe-sft checkpoint (converted or trained, any layout) into a single-rank model.

    The whole model in memory: for --verify and tests; `export` does not use it.
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    mcore_io.read_meta(ckpt_dir)
    family, hf_cfg = load_hf_config(ckpt_dir / mcore_io.HF_SUBDIR)
    model = single_rank_model(family, hf_cfg, precision)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt_dir), strict="assume_ok_unexpected")
    model.load_state_dict(state["model"])
    model.moe_sft_family, model.moe_sft_hf_config = family, hf_cfg
    return model


def _box_axes(view: View, offset: int, shape: tuple[int, ...]):
    """(unit axis walked by each view axis or None, unit coordinates of the view's first element)
    when the view is a box of the unit tensor (`shape`, contiguous), else None."""
    strides = torch.empty(shape, device="meta").stride()
    axes = []
    for n, stride in zip(view.shape, view.stride):
        match = [d for d in range(len(shape)) if shape[d] > 1 and strides[d] == stride and n <= shape[d]]
        if n > 1 and len(match) != 1:
            return None
        axes.append(match[0] if n > 1 else None)
    coords = [(offset // st) % n for st, n in zip(strides, shape)]
    walked = [a for a in axes if a is not None]
    if (
        len(set(walked)) != len(walked)
        or sum(c * st for c, st in zip(coords, strides)) != offset
        or any(coords[a] + n > shape[a] for a, n in zip(axes, view.shape) if a is not None)
    ):
        return None
    return axes, coords


def _read_unit(
    reader: DistCheckpointReader, param: ParamPlan, first: int, stop: int, buffer: torch.Tensor
) -> torch.Tensor:
    """Slices [first, stop) of the parameter (shape `param.unit_shape`), read box by box into the
    start of `buffer` (bytes; reused for every unit, so the result is valid until the next read).

    The memory is laid out as the checkpoint stores the largest box (GroupedMLP stores experts
    transposed, in HF's layout) and the result is a strided view of it in the parameter's
    coordinates: reading is a plain copy and the transform back to HF's layout copies nothing.
    """
    lo, shape = first * param.slice_elems, param.unit_shape(first, stop)
    parts = [(piece.key,) + part for piece in param.pieces if (part := piece.restrict(first, stop)) is not None]
    boxes = [_box_axes(view, view.offset - lo, shape) for _, _, view in parts]
    order = list(range(len(shape)))
    if parts and all(b is not None for b in boxes):
        largest = max(range(len(parts)), key=lambda i: torch.Size(parts[i][2].shape).numel())
        inner = [a for a in boxes[largest][0] if a is not None]
        order = [a for a in order if a not in inner] + inner
    # Storage offset 0 of the buffer: the as_strided offsets below are relative to the unit.
    temp = buffer[: torch.Size(shape).numel() * param.dtype.itemsize].view(param.dtype).view([shape[a] for a in order])
    unit = temp.permute([order.index(a) for a in range(len(shape))])
    filled = 0
    for (key, offsets, view), box in zip(parts, boxes):
        if box is None:  # the unit as the parameter's contiguous storage
            dest = temp.view(-1).as_strided(view.shape, view.stride, view.offset - lo)
        else:
            axes, coords = box
            dest = temp.as_strided(
                view.shape,
                [unit.stride(a) if a is not None else 0 for a in axes],
                sum(c * unit.stride(a) for a, c in enumerate(coords)),
            )
        reader.read_into(key, offsets, dest)
        filled += dest.numel()
    if filled != unit.numel():  # the boxes of one parameter never overlap (megatron validates them)
        raise RuntimeError(
            f"{param.entry.mcore}: the checkpoint boxes fill {filled} of the "
            f"{unit.numel()} elements of slices {first}:{stop}"
        )
    return unit


def _write_unit(
    writer: StreamingSafetensorsWriter, param: ParamPlan, first: int, stop: int, unit: torch.Tensor, ctx: dict
) -> None:
    """The HF tensors (or rows of them) that slices [first, stop) of the parameter give."""
    entry = param.entry
    if param.kind == "whole":
        for (name, _), tensor in zip(param.hf, entry.transform.to_hf(unit, ctx)):
            writer.write(name, tensor)
    elif param.kind == "experts":  # expert e's block alone gives its HF tensors
        per = len(entry.hf) // ctx["num_experts"]
        one = dict(ctx, num_experts=1)
        for e in range(first, stop):
            tensors = entry.transform.to_hf(unit[e - first], one)
            for name, tensor in zip(entry.hf[e * per : (e + 1) * per], tensors):
                writer.write(name, tensor)
    else:  # rows: HF row r is megatron row r (rows past the HF tensor's are vocab padding)
        casts: dict[int, torch.Tensor] = {}
        for name, shape in param.hf:  # DeepSeek-V3's MTP copies get the same rows
            end = min(stop, shape[0])
            if first < end:
                if end not in casts:
                    casts[end] = unit[: end - first].to(writer.dtype)
                writer.write_rows(name, first, casts[end])


@dataclasses.dataclass
class ExportStats:
    hf_tensors: int
    written_bytes: int  # HF tensor data written
    megatron_bytes: int  # megatron tensor data read from the checkpoint
    file_bytes: int  # bytes read from the checkpoint's files to do it
    units: int
    seconds: float


def export(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: str = "bf16",
    read_bytes: int = export_plan.DEFAULT_READ_BYTES,
    progress: Callable[[int, int], None] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the HF directory atomically, streaming; every megatron parameter is read and every
    HF tensor written exactly once (the gates in export_plan.py run before anything is read).

    `read_bytes` bounds a unit read at once; `progress(done, total)` follows the HF bytes written.
    Refused before anything is written (a CheckpointError naming the file and the fix): a
    non-empty `out_dir` (mcore_io.OutputDirError) unless `overwrite`, or unless it is the training
    run's own export dir holding only what an export writes (`_own_export_dir`); an `out_dir` that
    is, contains or lies inside a checkpoint read, even with `overwrite`; a damaged checkpoint
    (checksums.verify_files). A full disk raises DiskFullError with the partial export removed.
    """
    return export_with_stats(ckpt_dir, out_dir, max_shard_bytes, dtype, read_bytes, progress, overwrite)[0]


def _own_export_dir(ckpt_dir: Path, out_dir: Path) -> bool:
    """`out_dir` is the export of the training run that saved `ckpt_dir`: the trainer exports
    `<output_dir>/checkpoints/step_N` into `<output_dir>/hf` at the end of every run, a resumed
    one too, and replaces its own earlier export (moe_sft/trainer/checkpoint.py's layout). A file
    there that no export writes is the user's: the export stops (OutputDirError) rather than
    delete it with the rest."""
    ckpt, out = ckpt_dir.resolve(), out_dir.resolve()
    if not (
        ckpt.parent.name == "checkpoints"
        and mcore_io.STEP_DIR.fullmatch(ckpt.name) is not None
        and out == ckpt.parent.parent / mcore_io.HF_SUBDIR
    ):
        return False
    theirs = mcore_io.user_entries(out_dir, mcore_io.written_by_export(out_dir))
    if theirs:
        raise mcore_io.OutputDirError(mcore_io.user_entries_message(out_dir, theirs, "HF export"))
    return True


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.0f} kB"


def _disk_full(err: OSError, ckpt_dir: Path, out_dir: Path) -> DiskFullError:
    staging = out_dir.with_name(out_dir.name + ".tmp")
    mcore_io.discard_staging(staging)
    try:
        usage = shutil.disk_usage(out_dir.parent if out_dir.parent.is_dir() else ".")
        space = f" ({_size(usage.free)} free of {_size(usage.total)} on that filesystem)"
    except OSError:
        space = ""
    return DiskFullError(
        f"no space left writing {staging}{space}: removed the partial export; {ckpt_dir} is untouched. "
        f"Free space (the export needs about the checkpoint's model size in --dtype), then export again: "
        f"python tools/export_mcore_to_hf.py --mcore-path {ckpt_dir} --output {out_dir}"
    )


def export_with_stats(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: str = "bf16",
    read_bytes: int = export_plan.DEFAULT_READ_BYTES,
    progress: Callable[[int, int], None] | None = None,
    overwrite: bool = False,
) -> tuple[Path, ExportStats]:
    """`export`, also returning what it read and wrote."""
    started = time.time()
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    meta = mcore_io.read_meta(ckpt_dir)
    model_dir = adapter_merge.base_dir(ckpt_dir, meta) if adapter_merge.is_adapter_run(meta) else ckpt_dir
    sources = {"--mcore-path": ckpt_dir}
    if model_dir != ckpt_dir:
        sources["the base checkpoint (moe_sft_meta.json peft_base)"] = model_dir
    mcore_io.check_not_a_source(out_dir, sources)
    left = mcore_io.check_output(out_dir, overwrite, accept=lambda out: _own_export_dir(ckpt_dir, out))
    checksums.verify_files(ckpt_dir)
    if model_dir != ckpt_dir:
        checksums.verify_files(model_dir, f"the base checkpoint (moe_sft_meta.json peft_base) of {ckpt_dir},")
    if left:
        log.warning("replacing %s.tmp: %s", out_dir, left)
    try:
        return _export(ckpt_dir, out_dir, model_dir, meta, max_shard_bytes, dtype, read_bytes, progress, started)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise _disk_full(err, ckpt_dir, out_dir) from err


def _export(ckpt_dir, out_dir, model_dir, meta, max_shard_bytes, dtype, read_bytes, progress, started):
    """`export_with_stats` once its inputs and output are checked: plan, stream, publish."""
    family, hf_cfg, whole = load_hf_source(ckpt_dir / mcore_io.HF_SUBDIR)
    torch_dtype = DTYPES[dtype]
    reader = DistCheckpointReader(model_dir)
    copies_absent = mcore_io.read_meta(model_dir).get(mcore_io.COPIES_ABSENT, ())
    # a multimodal source: its other parts (vision tower), carried through since the conversion
    carried = composite.CarriedTensors(ckpt_dir) if whole is not None else None
    plan = export_plan.build(
        family, hf_cfg, reader, read_bytes, copies_absent, whole, carried.specs() if carried else ()
    )
    adapters = None
    if model_dir != ckpt_dir:
        adapters = adapter_merge.RunAdapters(ckpt_dir, meta, plan.ctx)
        readers = {p.entry.mcore: adapters.reader_for(p, reader) for p in plan.params}
        adapters.check_consumed(plan.params)
    writer = StreamingSafetensorsWriter(
        out_dir, plan.hf_specs(), torch_dtype, max_shard_bytes, source=str(ckpt_dir.resolve())
    )
    # One allocation for every unit, not one per unit: a fresh 16-256 MiB tensor per unit let
    # glibc's heap keep freed units resident now and then (+11 units of RSS in 1 run of ~6).
    buffer = torch.empty(max((p.largest_unit_bytes() for p in plan.params), default=0), dtype=torch.uint8)
    try:
        for param in plan.params:
            source = readers[param.entry.mcore] if adapters else reader
            merging = adapters is not None and adapters.adapted(param.entry.mcore) is not None
            for first, stop in param.units:
                unit = _read_unit(source, param, first, stop, buffer)
                if merging:
                    unit = adapters.merge(param, first, stop, unit)
                _write_unit(writer, param, first, stop, unit, plan.ctx)
                del unit
                if progress is not None:
                    progress(writer.written_bytes, writer.total_bytes)
        for name, shape in plan.empty:
            writer.write(name, torch.empty(shape, dtype=torch_dtype))
        if carried is not None:
            carried.write_into(writer)
        copied = mcore_io.copy_hf_side_files(ckpt_dir / mcore_io.HF_SUBDIR, writer.staging_dir, with_carried=False)
        if "generation_config.json" not in copied:  # generate() and serving stacks read it
            GenerationConfig.from_model_config(hf_cfg).save_pretrained(str(writer.staging_dir))
        hf_writer.finish_config(writer.staging_dir / "config.json", torch_dtype)  # the source's own, kept
        out = writer.close()
    except BaseException:
        writer.discard()
        raise
    stats = ExportStats(
        len(plan.hf_specs()),
        writer.total_bytes,
        reader.tensor_bytes + (adapters.reader.tensor_bytes if adapters else 0),
        reader.file_bytes + (adapters.reader.file_bytes if adapters else 0),
        sum(len(p.units) for p in plan.params),
        time.time() - started,
    )
    log.info(
        "exported %d HF tensors: %.2f GB written in %.1fs (%.0f MB/s); read %.2f GB in %d "
        "units, %.2f GB from the files",
        stats.hf_tensors,
        stats.written_bytes / 1e9,
        stats.seconds,
        stats.written_bytes / 1e6 / max(stats.seconds, 1e-9),
        stats.megatron_bytes / 1e9,
        stats.units,
        stats.file_bytes / 1e9,
    )
    return out, stats
