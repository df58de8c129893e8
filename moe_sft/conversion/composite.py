"""A multimodal checkpoint holding a family's language model (`Family.composite`: Qwen3.5's
vision-language release): the language model's HF names as that checkpoint spells them, and the
tensors carried through untouched (the vision tower).

The carried tensors are written at conversion into `<ckpt>/hf/carried/` (sharded safetensors and
their index, in the source's dtype), travel with the HF side files into every training checkpoint
(mcore_io.copy_hf_side_files) and are written back by the export beside the fine-tuned language
model, under their own names, with the source's config.json: the export is the source's model
class again. The megatron model never sees them; they are not trained.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_sft.conversion import mcore_io
from moe_sft.conversion.hf_reader import CheckpointError
from moe_sft.conversion.hf_writer import StreamingSafetensorsWriter
from moe_sft.conversion.mapping import Entry
from moe_sft.models.family import Composite, Family
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)

FLOATS = ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2")  # safetensors' names


@dataclass(frozen=True)
class CompositeSource:
    """A checkpoint of `spec.model_type`: its whole transformers config and how it holds the
    language model."""

    spec: Composite
    config: object

    def hf_name(self, name: str) -> str:
        """`name` as a text-only checkpoint spells it → as this checkpoint does."""
        for old, new in self.spec.renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def rename(self, entries: list[Entry]) -> list[Entry]:
        return [Entry(e.mcore, tuple(self.hf_name(n) for n in e.hf), e.transform) for e in entries]

    def carried(self, names) -> dict[str, list[str]]:
        """{what (e.g. "vision"): the names among `names` carried through as that}."""
        out = {}
        for pattern, what in self.spec.carried.items():
            matched = sorted(n for n in names if re.fullmatch(pattern, n))
            if matched:
                out.setdefault(what, []).extend(matched)
        return out


def of(family: Family, config) -> CompositeSource | None:
    """The composite view of a checkpoint whose config is `config` (its whole transformers
    config), or None for a checkpoint of the family's own (text-only) type."""
    spec = family.composite
    if spec is None or getattr(config, "model_type", None) != spec.model_type:
        return None
    return CompositeSource(spec, config)


def carried_names(carried: dict[str, list[str]]) -> list[str]:
    return sorted(n for names in carried.values() for n in names)


def describe(carried: dict[str, list[str]]) -> str:
    """What is carried, in words: "19 vision tensors" (one part per kind)."""
    return ", ".join(f"{len(names)} {what} tensor{'s' if len(names) != 1 else ''}" for what, names in carried.items())


def write_carried(reader, names: list[str], side_dir: Path, dtype: torch.dtype) -> int:
    """Copy the tensors `names` from the HF source (`reader`, one tensor in memory at a time)
    into `side_dir/carried/` in `dtype` (the source's float dtype: bf16 stays bit-identical; an
    FP8 tensor is dequantised, as the language model is, since the export's config.json has no
    `quantization_config`). Returns the bytes written."""
    specs = []
    for name in names:
        if reader.is_mxfp4(name):
            raise CheckpointError(
                f"{reader.file_of(name)}: {name} is stored MXFP4; moe-sft carries only unquantised or FP8 "
                "tensors of the non-language parts through; dequantise the checkpoint first"
            )
        stored = reader.stored_dtype(name)
        if stored not in FLOATS:
            raise CheckpointError(
                f"{reader.file_of(name)}: {name} is a {stored} tensor; only floating tensors are carried "
                "through (the export writes one dtype)"
            )
        specs.append((name, reader.tensor_shape(name)))
    writer = StreamingSafetensorsWriter(side_dir / mcore_io.CARRIED_DIR, specs, dtype, source=str(reader.path))
    try:
        for name in names:
            writer.write(name, reader.get(name))
        writer.close()
    except BaseException:
        writer.discard()
        raise
    return writer.total_bytes


class CarriedTensors:
    """The carried tensors of a checkpoint (`<ckpt>/hf/carried/`), read one at a time."""

    def __init__(self, ckpt_dir: Path):
        self.dir = Path(ckpt_dir) / mcore_io.HF_SUBDIR / mcore_io.CARRIED_DIR
        index = self.dir / mcore_io.EXPORT_INDEX
        if not index.is_file():
            raise CheckpointError(
                f"{self.dir}: missing (or no {mcore_io.EXPORT_INDEX}): this checkpoint of a multimodal source "
                "lost the tensors conversion carried through (vision tower); reconvert the source, or copy "
                "hf/carried/ from the converted checkpoint this run trained"
            )
        self.files = json.loads(index.read_text())["weight_map"]

    def specs(self) -> list[tuple[str, tuple[int, ...]]]:
        from safetensors import safe_open

        out = []
        for file in sorted(set(self.files.values())):
            with safe_open(str(self.dir / file), framework="pt") as f:
                out += [(n, tuple(f.get_slice(n).get_shape())) for n in f.keys()]
        return sorted(out)

    def write_into(self, writer: StreamingSafetensorsWriter) -> None:
        from safetensors import safe_open

        for file in sorted(set(self.files.values())):
            with safe_open(str(self.dir / file), framework="pt") as f:
                for name in f.keys():
                    writer.write(name, f.get_tensor(name))
