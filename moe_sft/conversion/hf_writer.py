"""Sharded safetensors writer with the HF index json: bounded memory, atomic directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


class ShardedSafetensorsWriter:
    """Accumulate tensors up to `max_shard_bytes`, flush a shard, finally write the index.

    Writes into `<out>.tmp` and renames on `close()`, so a killed export leaves no half model.
    """

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 5 * 1024**3):
        self.out_dir = Path(out_dir)
        self.tmp_dir = self.out_dir.with_name(self.out_dir.name + ".tmp")
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir(parents=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    @property
    def staging_dir(self) -> Path:
        return self.tmp_dir

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in s for s in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        index = len(self._shards)
        save_file(self._pending, str(self.tmp_dir / f"shard-{index}.safetensors"),
                  metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> Path:
        if self._pending:
            self._flush()
        count = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.tmp_dir / f"shard-{i}.safetensors", self.tmp_dir / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.tmp_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp_dir, self.out_dir)
        return self.out_dir
