"""moe-sft dist checkpoint → HF directory (sharded safetensors, index, config, tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig

from moe_sft.conversion import mapping, mcore_io
from moe_sft.conversion.hf_writer import ShardedSafetensorsWriter


def load_model_from_checkpoint(ckpt_dir: str | Path, precision: str = "fp32"):
    """Load any moe-sft checkpoint (converted or trained, any layout) into a single-rank model."""
    from megatron.core import dist_checkpointing
    from moe_sft.conversion.convert import load_hf_config, single_rank_model

    ckpt_dir = Path(ckpt_dir)
    mcore_io.read_meta(ckpt_dir)
    family, hf_cfg = load_hf_config(ckpt_dir / mcore_io.HF_SUBDIR)
    model = single_rank_model(family, hf_cfg, precision)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt_dir),
                                    strict="assume_ok_unexpected")
    model.load_state_dict(state["model"])
    model.moe_sft_family, model.moe_sft_hf_config = family, hf_cfg
    return model


def export(ckpt_dir: str | Path, out_dir: str | Path, max_shard_bytes: int = 5 * 1024**3,
           dtype: str = "bf16") -> Path:
    """Write the HF directory atomically; every mapped tensor is written exactly once."""
    ckpt_dir = Path(ckpt_dir)
    model = load_model_from_checkpoint(ckpt_dir)
    family, hf_cfg = model.moe_sft_family, model.moe_sft_hf_config
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    entries = mapping.expand(family, hf_cfg)
    ctx = mapping.transform_context(family, hf_cfg)
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes)
    state = model.state_dict()
    for name, tensor in mapping.state_to_hf(entries, state, ctx):
        writer.add(name, tensor.to(torch_dtype))
    copied = mcore_io.copy_hf_side_files(ckpt_dir / mcore_io.HF_SUBDIR, writer.staging_dir)
    if "generation_config.json" not in copied:  # generate() and serving stacks read it
        GenerationConfig.from_model_config(hf_cfg).save_pretrained(str(writer.staging_dir))
    hf_cfg.dtype = torch_dtype  # written to config.json as "dtype" (transformers 5)
    if hasattr(hf_cfg, "quantization_config"):  # an FP8 source is exported dequantised
        del hf_cfg.quantization_config
    hf_cfg.save_pretrained(str(writer.staging_dir))
    return writer.close()
