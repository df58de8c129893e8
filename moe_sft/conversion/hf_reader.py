"""What every reader of an HF checkpoint directory shares: the index, header and dtype checks,
FP8 and MXFP4 dequantisation and the error messages; subclasses read a tensor's bytes (`_read`:
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

from moe_sft.conversion import fp8, mxfp4


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
        self._mxfp4: dict[str, list[str]] | None = None  # _mxfp4_parts, found on first use

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

    def _mxfp4_parts(self) -> dict[str, list[str]]:
        """Presented name `X` → its stored MXFP4 parts (`X_blocks`, `X_scales`, or the one present).

        Only uint8 parts count: a float tensor that happens to end in `_scales` stays itself."""
        if self._mxfp4 is None:
            parts: dict[str, list[str]] = {}
            for stored, file in self._name_to_file.items():
                base = mxfp4.base_name(stored)
                if base is not None and self._stored_dtype(stored) == mxfp4.STORED_DTYPE:
                    if base in self._name_to_file:
                        raise CheckpointError(
                            f"{file}: {base!r} is stored both plain and as MXFP4 {stored!r}; "
                            "the checkpoint mixes two saves, re-download it"
                        )
                    parts.setdefault(base, []).append(stored)
            self._mxfp4 = {base: sorted(stored) for base, stored in parts.items()}
        return self._mxfp4

    def _stored_dtype(self, stored: str) -> str:
        return self._open(self._name_to_file[stored]).get_slice(stored).get_dtype()

    def stored_dtype(self, name: str) -> str:
        """safetensors' dtype name ("BF16", "F8_E4M3", ...) of `name` as stored."""
        return self._stored_dtype(self.stored_name(name))

    def names(self) -> set[str]:
        """Tensor names as the model sees them: FP8 scales are consumed by their weights, MXFP4
        `X_blocks` + `X_scales` are presented as the one parameter `X`."""
        parts = self._mxfp4_parts()
        hidden = {stored for stored_parts in parts.values() for stored in stored_parts}
        plain = {n for n in self._name_to_file if not n.endswith(fp8.SCALE_SUFFIX) and n not in hidden}
        return plain | set(parts)

    def is_mxfp4(self, name: str) -> bool:
        """Whether the presented `name` is stored as MXFP4 blocks + scales."""
        return name in self._mxfp4_parts()

    def stored_name(self, name: str) -> str:
        """The stored tensor whose header describes `name`: its MXFP4 blocks (or the part present),
        else `name` itself."""
        parts = self._mxfp4_parts().get(name)
        if parts is None:
            return name
        return mxfp4.blocks_name(name) if mxfp4.blocks_name(name) in parts else parts[0]

    def is_fp8(self, name: str) -> bool:
        if self.is_mxfp4(name):
            return False
        return self._stored_dtype(name) in fp8.FP8_DTYPES

    def file_of(self, name: str) -> Path:
        return self._name_to_file[self.stored_name(name)]

    def get(self, name: str) -> torch.Tensor:
        if self.is_mxfp4(name):
            return self._get_mxfp4(name)
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

    def _get_mxfp4(self, name: str) -> torch.Tensor:
        blocks, scales = mxfp4.blocks_name(name), mxfp4.scales_name(name)
        for present, missing in ((blocks, scales), (scales, blocks)):
            if missing not in self._name_to_file:
                raise CheckpointError(
                    f"{self._name_to_file[present]}: MXFP4 tensor {present!r} has no {missing!r}; "
                    f"the checkpoint is incomplete (re-download the shard that holds the {missing.rsplit('_', 1)[1]})"
                )
        try:
            return mxfp4.dequantize(self._read(blocks), self._read(scales))
        except ValueError as err:
            raise CheckpointError(f"{self._name_to_file[blocks]}: {name}: {err}") from err

    @abstractmethod
    def _read(self, name: str) -> torch.Tensor:
        """The stored tensor `name` as it is on disk (StreamingHFReader: plain file reads)."""

    def dtypes(self) -> dict[str, set[str]]:
        """Floating dtypes per shard file (read from headers only); MXFP4 parts count as one
        "MXFP4" entry, which is no float dtype to mix (hf_source.check_dtypes)."""
        mxfp4_parts = {stored for parts in self._mxfp4_parts().values() for stored in parts}
        out: dict[str, set[str]] = {}
        for name, file in self._name_to_file.items():
            if name.endswith(fp8.SCALE_SUFFIX):  # fp32 scales sit beside bf16/fp8 weights by design
                continue
            dtype = "MXFP4" if name in mxfp4_parts else self._stored_dtype(name)
            out.setdefault(file.name, set()).add(dtype)
        return out
