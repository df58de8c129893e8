"""Synthetic HF checkpoints of any size, written shard by shard with a few MB of memory.

For measuring the converter (tools/bench_convert_memory.py, tests/cpu/test_streaming_convert.py),
not for training: every tensor is one fixed random block repeated. Names and shapes come from the
family's mapping table and the megatron model built on the meta device (`Transform.to_hf` of meta
tensors), so the checkpoint is exactly what the converter expects of a real one.

    write_synthetic_checkpoint(path, hf_cfg) -> bytes of tensor data written
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from moe_sft.conversion import mapping
from moe_sft.conversion.meta_model import meta_model
from moe_sft.conversion.streaming_reader import DTYPES
from moe_sft.models import registry

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
BLOCK_ELEMENTS = 1 << 22


def hf_tensor_specs(family, hf_cfg, precision: str = "bf16") -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor an HF checkpoint of `hf_cfg` holds, in mapping order."""
    model = meta_model(family, hf_cfg, precision)
    state = model.state_dict(keep_vars=True)
    ctx = mapping.transform_context(family, hf_cfg)
    specs = []
    for entry in mapping.expand(family, hf_cfg):
        tensors = entry.transform.to_hf(state[entry.mcore].detach(), ctx)
        specs += [(name, tuple(t.shape)) for name, t in zip(entry.hf, tensors)]
    return specs


def _write_shard(file: Path, specs: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, block: bytes) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in specs:
        size = itemsize * torch.Size(shape).numel()
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for name, _ in specs:
            begin, end = header[name]["data_offsets"]
            left = end - begin
            while left > 0:
                piece = block[:left]
                out.write(piece)
                left -= len(piece)
    return offset


def write_synthetic_checkpoint(
    path: str | Path,
    hf_cfg,
    family=None,
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = 4 * 2**30,
    seed: int = 0,
) -> int:
    """config.json + sharded *.safetensors + index; returns the bytes of tensor data."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    family = family or registry.family_for_model_type(hf_cfg.model_type)
    specs = hf_tensor_specs(family, hf_cfg, "bf16" if dtype == torch.bfloat16 else "fp32")
    g = torch.Generator().manual_seed(seed)
    block = (torch.randn(BLOCK_ELEMENTS, generator=g) * 0.02).to(dtype).view(torch.uint8).numpy().tobytes()
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards, current, size = [], [], 0
    for name, shape in specs:
        nbytes = itemsize * torch.Size(shape).numel()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(path / file, shard, dtype, block)
        weight_map.update({name: file for name, _ in shard})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    hf_cfg.dtype = dtype
    hf_cfg.save_pretrained(str(path))
    return total
