"""Helpers of the vision-language checkpoint tests (tests/cpu/test_qwen3_5_vl.py, test_gemma4_vl.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from moe_sft.runtime import cpu_compat

PARITY_TOL = 1e-4  # fp32 on CPU, as tests/cpu/test_families.py
# the second document longer than the tiny models' sliding window (16)
DOCS = [[5, 17, 42, 99, 3, 250, 11], list(range(20, 61))]


def tensors(path: Path) -> dict:
    """Every tensor of a safetensors checkpoint directory, by name."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def load_vl(model_class, path: Path):
    """(model in eval mode, transformers' loading info) of an exported VL checkpoint, fp32."""
    with cpu_compat.suspended():
        model, info = model_class.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def text_logits(model) -> list[torch.Tensor]:
    """The multimodal model on text alone (no image, no audio): its language model's logits per DOCS."""
    with cpu_compat.suspended(), torch.no_grad():
        return [model(input_ids=torch.tensor([d])).logits[0].float() for d in DOCS]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))
