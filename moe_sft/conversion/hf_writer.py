"""Sharded safetensors written tensor by tensor straight into their files: memory is what is in flight.

Every tensor's name, shape and dtype is known before the first one is produced (export_plan.py),
so the shards, their headers and every tensor's byte range are laid out up front: tensors are cut
into shards in the given order (a shard closes when the next tensor would pass `max_shard_bytes`,
as before), and each shard is laid out as `safetensors.torch.save_file` lays it out (header JSON
with `__metadata__` first, tensors ordered by name, data in that order, header padded with spaces
to 8 bytes), so the files are byte-identical to save_file's (tested). Each tensor, or a range of
its rows, is then written at its offset with `pwrite` as soon as it is made and dropped; nothing
is buffered. `close()` checks every tensor was written exactly once, writes the index json and
publishes the directory atomically (`<out>.tmp` renamed), so a failed export leaves no half model.
The caller decides whether `<out>` may be replaced (mcore_io.check_output); the staging dir holds
a stamp (mcore_io.EXPORT_STAMP, naming the source) until it is published, so an interrupted export
is told apart from someone else's `<out>.tmp`.

Format: https://github.com/huggingface/safetensors#format
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from moe_sft.conversion import mcore_io

DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}
_MAX_IO = 1 << 30  # one pwrite moves at most ~2 GiB on Linux; stay well below


def finish_config(config_file: Path, dtype: torch.dtype) -> None:
    """The exported config.json: the source's own (copied with the checkpoint, every field kept:
    remote-code fields such as DeepSeek-V3's `topk_method` / `scoring_func`, MiniMax-M2's
    `rotary_dim`, `auto_map`, which transformers' config classes do not all write back and
    serving engines read), changed only where the export changes the model: the weights' dtype,
    and no `quantization_config` (an FP8 / MXFP4 source is exported dequantised)."""
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config]  # transformers 5 writes `dtype`
    for key in keys or ["dtype"]:
        config[key] = name
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


class WriteError(RuntimeError):
    """A tensor written twice, in another shape, or never."""


class _Slot:
    """Where one tensor's bytes go and which of its rows have arrived."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, file: str):
        self.name, self.shape, self.dtype, self.file = name, tuple(shape), dtype, file
        self.nbytes = torch.Size(shape).numel() * dtype.itemsize
        self.rows = shape[0] if shape else 1
        self.row_bytes = self.nbytes // self.rows if self.rows else 0
        self.offset = 0  # absolute, in `file`
        self.written: list[tuple[int, int]] = []  # row ranges

    def take(self, start: int, stop: int) -> None:
        if not 0 <= start < stop <= self.rows and not (start == stop == 0 == self.rows):
            raise WriteError(f"{self.name}: rows {start}:{stop} outside its {self.rows} rows")
        if any(a < stop and start < b for a, b in self.written):
            raise WriteError(f"tensor {self.name!r} written twice (rows {start}:{stop})")
        self.written.append((start, stop))

    def complete(self) -> bool:
        return sum(b - a for a, b in self.written) == self.rows and (self.rows or self.written)


def _layout(slots: list[_Slot]) -> bytes:
    """The shard's header (8-byte length + JSON) as save_file writes it; sets each slot's offset.

    save_file orders tensors by dtype, then name; all of a shard's tensors have one dtype here.
    """
    ordered = sorted(slots, key=lambda s: s.name)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for slot in ordered:
        header[slot.name] = {
            "dtype": DTYPE_NAMES[slot.dtype],
            "shape": list(slot.shape),
            "data_offsets": [offset, offset + slot.nbytes],
        }
        slot.offset = offset
        offset += slot.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    for slot in ordered:
        slot.offset += 8 + len(raw)
    return len(raw).to_bytes(8, "little") + raw


def shard_of(sizes: list[int], max_shard_bytes: int) -> list[int]:
    """Shard index of each tensor: in order, a new shard when the next one would pass the limit."""
    index, used, out = 0, 0, []
    for size in sizes:
        if used and used + size > max_shard_bytes:
            index, used = index + 1, 0
        out.append(index)
        used += size
    return out


class StreamingSafetensorsWriter:
    """Write the planned tensors (name, shape) in `dtype` into `<out>.tmp`, published on close()."""

    def __init__(
        self,
        out_dir: str | Path,
        specs: list[tuple[str, tuple[int, ...]]],
        dtype: torch.dtype,
        max_shard_bytes: int = 5 * 1024**3,
        source: str = "",
    ):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {dtype}: the writer handles {sorted(map(str, DTYPE_NAMES))}")
        self.out_dir = Path(out_dir)
        self.tmp_dir = self.out_dir.with_name(self.out_dir.name + ".tmp")
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir(parents=True)
        (self.tmp_dir / mcore_io.EXPORT_STAMP).write_text(source)
        self.dtype = dtype
        names = [n for n, _ in specs]
        if len(set(names)) != len(names):
            raise WriteError(f"tensors planned twice: {sorted({n for n in names if names.count(n) > 1})[:10]}")
        itemsize = dtype.itemsize
        shards = shard_of([torch.Size(s).numel() * itemsize for _, s in specs], max_shard_bytes)
        count = shards[-1] + 1 if shards else 0
        files = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self._slots = {n: _Slot(n, s, dtype, files[i]) for (n, s), i in zip(specs, shards)}
        self.total_bytes = sum(s.nbytes for s in self._slots.values())
        self.written_bytes = 0
        self._fds: dict[str, int] = {}
        for file in files:
            slots = [s for s in self._slots.values() if s.file == file]
            header = _layout(slots)
            fd = os.open(self.tmp_dir / file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds[file] = fd
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, len(header) + sum(s.nbytes for s in slots))

    @property
    def staging_dir(self) -> Path:
        return self.tmp_dir

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The whole tensor `name`, cast to the writer's dtype."""
        slot = self._slot(name)
        if tuple(tensor.shape) != slot.shape:
            raise WriteError(f"{name}: shape {tuple(tensor.shape)}, planned {slot.shape}")
        slot.take(0, slot.rows)
        self._pwrite(slot, tensor, 0)

    def write_rows(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Rows [start, start + len(rows)) of tensor `name` (cast to the writer's dtype)."""
        slot = self._slot(name)
        if tuple(rows.shape[1:]) != slot.shape[1:]:
            raise WriteError(f"{name}: rows of shape {tuple(rows.shape[1:])}, planned {slot.shape[1:]}")
        slot.take(start, start + rows.shape[0])
        self._pwrite(slot, rows, start * slot.row_bytes)

    def _slot(self, name: str) -> _Slot:
        if name not in self._slots:
            raise WriteError(f"tensor {name!r} was not planned")
        return self._slots[name]

    def _pwrite(self, slot: _Slot, tensor: torch.Tensor, at: int) -> None:
        data = tensor.detach().to(self.dtype).contiguous().view(-1).view(torch.uint8).numpy()
        buffer, fd, done = memoryview(data), self._fds[slot.file], 0
        while done < len(buffer):
            done += os.pwrite(fd, buffer[done : done + _MAX_IO], slot.offset + at + done)
        self.written_bytes += len(buffer)

    def missing(self) -> list[str]:
        return sorted(n for n, s in self._slots.items() if not s.complete())

    def close(self) -> Path:
        """Check completeness, sync, write the index and publish the directory."""
        missing = self.missing()
        if missing:
            self.discard()
            raise WriteError(
                f"{len(missing)} planned tensor(s) were not (completely) written: {', '.join(missing[:20])}"
            )
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()
        weight_map = {n: s.file for n, s in sorted(self._slots.items())}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.tmp_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (self.tmp_dir / mcore_io.EXPORT_STAMP).unlink()
        mcore_io.commit_dir(self.tmp_dir, self.out_dir)
        return self.out_dir

    def discard(self) -> None:
        """Close the files and remove the staging directory (a failed export leaves nothing)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
