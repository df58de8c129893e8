"""A tiny GLM-4.5 HF checkpoint *with* an MTP layer, in the released checkpoints' layout.

GLM-4.5's MTP layer is DeepSeek-V3's (vLLM's glm4_moe_mtp.py, Megatron-Bridge's GLM-4.5 bridge):
`model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,embed_tokens}` + a full
decoder layer, the same computation. transformers' Glm4MoeForCausalLM neither saves nor runs it,
so the reference of tests/deepseek_mtp.py is reused with GLM's decoder layer and norm.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm

from moe_sft.models import glm4_moe
from moe_sft.runtime import cpu_compat
from tests.deepseek_mtp import ReferenceMTP, reference_logits

__all__ = ["GlmReferenceMTP", "reference_logits", "write_tiny_glm4_moe_with_mtp"]


class GlmReferenceMTP(ReferenceMTP):
    """tests/deepseek_mtp.py's ReferenceMTP (its hf_tensors and forward) with GLM's modules."""

    def __init__(self, cfg, layer_idx: int):
        torch.nn.Module.__init__(self)
        h = cfg.hidden_size
        self.enorm = Glm4MoeRMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = Glm4MoeRMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.layer = Glm4MoeDecoderLayer(cfg, layer_idx)
        self.head_norm = Glm4MoeRMSNorm(h, cfg.rms_norm_eps)


@torch.no_grad()
def _perturb(hf, mtp, std: float, bias_scale: float) -> None:
    """Off the init values: bare modules hold torch.empty memory, norms sit at 1, biases at 0."""
    for param in mtp.parameters():
        if param.dim() >= 2:
            torch.nn.init.normal_(param, std=std)
    for name, tensor in list(hf.named_parameters()) + list(mtp.named_parameters()):
        if tensor.dim() == 1:  # norm weights around 1, q/k/v biases around 0
            base = 1.0 if name.endswith("norm.weight") else 0.0
            tensor.copy_(base + 0.3 * torch.randn_like(tensor))
    for name, tensor in list(hf.named_buffers()) + list(mtp.named_buffers()):
        if name.endswith("e_score_correction_bias"):  # zeros at init: make it steer routing
            tensor.copy_(torch.randn_like(tensor) * bias_scale)


def write_tiny_glm4_moe_with_mtp(path: Path, vocab_size: int, seed: int = 0, bias_scale: float = 0.5, **overrides):
    """Save a tiny random GLM-4.5 with one MTP layer; returns (HF model, reference MTP layer).

    `bias_scale`: spread of the expert bias; 0.5 steers routing hard (some experts get no token)."""
    cfg = glm4_moe.tiny_hf_config(vocab_size=vocab_size, num_nextn_predict_layers=1, **overrides)
    with cpu_compat.suspended():
        torch.manual_seed(seed)
        hf = glm4_moe.FAMILY.hf_model_class(cfg).eval()
        mtp = GlmReferenceMTP(hf.config, cfg.num_hidden_layers).eval()
        _perturb(hf, mtp, cfg.initializer_range, bias_scale)
        hf.save_pretrained(str(path))
        extra = mtp.hf_tensors(
            f"model.layers.{cfg.num_hidden_layers}.", hf.model.embed_tokens.weight, hf.lm_head.weight
        )
        save_file(extra, str(path / "mtp.safetensors"))
    return hf, mtp
