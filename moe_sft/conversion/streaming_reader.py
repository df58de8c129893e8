"""HF safetensors tensors read with plain file reads (`preadv`), never through a memory map.

`HFCheckpointReader` reads through safetensors' `safe_open`, which maps every shard into the
process: each page a tensor was read from then counts in the converter's resident set until the
kernel evicts it, so converting a 30 GB checkpoint shows a ~30 GB RSS although only one tensor is
alive. This subclass keeps the parent's index, header checks, dtype checks, FP8 dequantisation and
error messages, and replaces only the read of a tensor's bytes: they go straight from the file
into the tensor's own memory, so a tensor costs its size and nothing stays behind.

Format (https://github.com/huggingface/safetensors#format): 8 bytes little-endian header length
N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}}, then the data; offsets are
relative to byte 8 + N.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from moe_sft.conversion.file_io import OpenFiles
from moe_sft.conversion.hf_reader import CheckpointError, HFCheckpointReader

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_READ = 1 << 30  # one preadv call reads at most ~2 GiB on Linux; stay well below


class StreamingHFReader(HFCheckpointReader):
    """`HFCheckpointReader` whose tensors are read into fresh memory with preadv (no mmap)."""

    def __init__(self, path: str | Path, fp8_block: tuple[int, int] = (128, 128)):
        super().__init__(path, fp8_block)
        self._headers: dict[Path, tuple[int, dict]] = {}
        self._files = OpenFiles()

    def _header(self, file: Path) -> tuple[int, dict]:
        if file not in self._headers:
            with open(file, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            self._headers[file] = (8 + length, header)
        return self._headers[file]

    def _read(self, name: str) -> torch.Tensor:
        file = self._name_to_file[name]
        try:
            data_start, header = self._header(file)
            info = header[name]
            dtype, shape = DTYPES[info["dtype"]], info["shape"]
            begin, end = info["data_offsets"]
            raw = torch.empty(end - begin, dtype=torch.uint8)
            self._read_into(file, raw, data_start + begin)
            return raw.view(dtype).reshape(shape)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"{file}: reading tensor {name!r} failed ({err}); the file is truncated or corrupt"
            ) from err

    def empty_names(self) -> set[str]:
        """Tensors with no elements (e.g. DeepSeek-V3's shared experts when n_shared_experts=0)."""
        return {n for n in self.names() if 0 in self._stored_shape(self.stored_name(n))}

    def _stored_shape(self, stored: str) -> list[int]:
        return self._header(self._name_to_file[stored])[1][stored]["shape"]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape `get` returns for an unquantised or FP8 tensor (FP8 blocks keep the shape)."""
        return tuple(self._stored_shape(self.stored_name(name)))

    def row_shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape when `get_rows` can read it (stored unquantised, at least 1-D)."""
        if self.is_mxfp4(name):
            return None
        if name not in self._name_to_file:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        info = self._header(self._name_to_file[name])[1][name]
        if (
            info["dtype"] not in DTYPES
            or DTYPES[info["dtype"]] in (torch.float8_e4m3fn, torch.float8_e5m2)
            or not info["shape"]
        ):
            return None
        return tuple(info["shape"])

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of an unquantised tensor, reading only their bytes."""
        file = self._name_to_file[name]
        data_start, header = self._header(file)
        info = header[name]
        dtype, shape = DTYPES[info["dtype"]], info["shape"]
        row_bytes = torch.empty((), dtype=dtype).element_size() * torch.Size(shape[1:]).numel()
        raw = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        try:
            self._read_into(file, raw, data_start + info["data_offsets"][0] + start * row_bytes)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"{file}: reading rows {start}:{stop} of {name!r} failed ({err}); the file is truncated or corrupt"
            ) from err
        return raw.view(dtype).reshape([stop - start] + list(shape[1:]))

    def _read_into(self, file: Path, raw: torch.Tensor, offset: int) -> None:
        buffer = memoryview(raw.numpy()).cast("B")
        done = 0
        while done < len(buffer):
            got = os.preadv(self._files.fd(file), [buffer[done : done + _MAX_READ]], offset + done)
            if got <= 0:
                raise CheckpointError(
                    f"{file}: ends at byte {offset + done}, {len(buffer) - done} "
                    "bytes short of a tensor; the file is truncated, re-download it"
                )
            done += got

    def close(self) -> None:
        self._files.close()
