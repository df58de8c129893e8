"""What every reader of an HF checkpoint directory shares: the index, header and dtype checks,
FP8 dequantisation and the error messages; subclasses read a tensor's bytes (`_read`:
streaming_reader.py reads them with plain file reads, tests/safe_open_reader.py through safetensors).

Every failure names the file (and tensor): no config.json, no weights, an index naming a missing
shard, a truncated or corrupt safetensors file, mixed dtypes across shards.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors import safe_open

from moe_sft.conversion import fp8


class CheckpointError(ValueError):
    """The HF checkpoint on disk is unusable; the message names the file and the fix."""


class HFCheckpointReader(ABC):
    """Base of the HF checkpoint readers: one tensor in memory at a time."""

    def __init__(self, path: str | Path, fp8_block: tuple[int, int] = (128, 128)):
        self.path = Path(path)
        self.fp8_block = fp8_block
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: HF checkpoint directory does not exist")
        if not (self.path / "config.json").is_file():
            raise CheckpointError(
                f"{self.path}: no config.json; point --hf-path at the directory holding config.json and *.safetensors"
            )
        self._handles: dict[str, object] = {}
        self._name_to_file = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from err
            files = {f: self.path / f for f in set(weight_map.values())}
            for name, file in sorted(files.items()):
                if not file.is_file():
                    raise CheckpointError(
                        f"{index} names shard {name}, which is missing from {self.path}; re-download the checkpoint"
                    )
            return {t: files[f] for t, f in weight_map.items()}
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(
                f"{self.path}: no *.safetensors files (PyTorch .bin checkpoints "
                "are not supported; re-save with safe_serialization=True)"
            )
        mapping = {}
        for shard in shards:
            for name in self._open(shard).keys():
                mapping[name] = shard
        return mapping

    def _open(self, file: Path):
        key = str(file)
        if key not in self._handles:
            try:
                self._handles[key] = safe_open(key, framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise CheckpointError(
                    f"{file}: cannot read safetensors header ({err}); the file is truncated or corrupt, re-download it"
                ) from err
        return self._handles[key]

    def names(self) -> set[str]:
        """Tensor names as the model sees them: FP8 scales are consumed by their weights."""
        return {n for n in self._name_to_file if not n.endswith(fp8.SCALE_SUFFIX)}

    def is_fp8(self, name: str) -> bool:
        file = self._name_to_file[name]
        return self._open(file).get_slice(name).get_dtype() in fp8.FP8_DTYPES

    def file_of(self, name: str) -> Path:
        return self._name_to_file[name]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._name_to_file:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        tensor = self._read(name)
        if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return tensor
        scale = fp8.scale_name(name)
        if scale not in self._name_to_file:
            raise CheckpointError(
                f"{self._name_to_file[name]}: FP8 tensor {name!r} has no {scale!r}; "
                "the checkpoint is incomplete (re-download the shard that holds the scales)"
            )
        try:
            return fp8.dequantize_blocks(tensor, self._read(scale), self.fp8_block)
        except ValueError as err:
            raise CheckpointError(f"{self._name_to_file[scale]}: {scale}: {err}") from err

    @abstractmethod
    def _read(self, name: str) -> torch.Tensor:
        """The stored tensor `name` as it is on disk (StreamingHFReader: plain file reads)."""

    def dtypes(self) -> dict[str, set[str]]:
        """Floating dtypes per shard file (read from headers only)."""
        out: dict[str, set[str]] = {}
        for name, file in self._name_to_file.items():
            if name.endswith(fp8.SCALE_SUFFIX):  # fp32 scales sit beside bf16/fp8 weights by design
                continue
            dtype = self._open(file).get_slice(name).get_dtype()
            out.setdefault(file.name, set()).add(dtype)
        return out
