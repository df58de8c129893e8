"""A tiny DeepSeek-V3 HF checkpoint *with* multi-token-prediction layers, and a reference MTP forward.

transformers' DeepseekV3ForCausalLM neither saves nor runs MTP layers, so the test writes them
itself in the official checkpoint's layout (`model.layers.{N}.{enorm,hnorm,eh_proj,
shared_head.norm,shared_head.head,embed_tokens}` + a full decoder layer) and computes MTP logits
as the DeepSeek-V3 report defines them, from HF's own decoder-layer and norm modules:

    h'_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]),   logits_i = Head(norm(Layer(h'_i)))

where h_i is the main model's output after its final norm (as megatron's MTP block and vLLM's
DeepSeek MTP consume it) and logits_i predicts t_{i+2}.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from moe_sft.models import registry
from moe_sft.runtime import cpu_compat


class ReferenceMTP(torch.nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = DeepseekV3RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekV3DecoderLayer(cfg, layer_idx)
        self.head_norm = DeepseekV3RMSNorm(h, cfg.rms_norm_eps)

    def hf_tensors(self, prefix: str, embed: torch.Tensor, head: torch.Tensor) -> dict:
        out = {
            f"{prefix}enorm.weight": self.enorm.weight,
            f"{prefix}hnorm.weight": self.hnorm.weight,
            f"{prefix}eh_proj.weight": self.eh_proj.weight,
            f"{prefix}shared_head.norm.weight": self.head_norm.weight,
            f"{prefix}embed_tokens.weight": embed,
            f"{prefix}shared_head.head.weight": head,
        }
        out.update(decoder_layer_tensors(self.layer, prefix))
        return {k: v.detach().clone().contiguous() for k, v in out.items()}


def decoder_layer_tensors(layer: torch.nn.Module, prefix: str) -> dict:
    """A transformers decoder layer's tensors as a checkpoint stores them: per expert."""
    out = {}
    for name, value in layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # transformers 5 fuses experts in memory [E, 2F, H]
            ffn = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = value[e, :ffn]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = value[e, ffn:]
        elif name == "mlp.experts.down_proj":  # [E, H, F]
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[prefix + name] = value
    return out


def write_tiny_deepseek_with_mtp(path: Path, vocab_size: int, seed: int = 0, **overrides):
    """Save a tiny random DeepSeek-V3 with one MTP layer; returns (HF model, reference MTP layer)."""
    family = registry.family_by_name("deepseek_v3")
    cfg = family.tiny_hf_config(vocab_size=vocab_size, num_nextn_predict_layers=1, **overrides)
    with cpu_compat.suspended():
        torch.manual_seed(seed)
        hf = family.hf_model_class(cfg).eval()
        mtp = ReferenceMTP(hf.config, cfg.num_hidden_layers).eval()
        with torch.no_grad():
            # HF initialises weights in the PreTrainedModel's post_init, not in submodule
            # constructors: a bare decoder layer holds torch.empty memory (NaN now and then).
            for param in mtp.parameters():
                if param.dim() >= 2:
                    torch.nn.init.normal_(param, std=cfg.initializer_range)
            for name, tensor in list(hf.named_buffers()) + list(mtp.named_buffers()):
                if name.endswith("e_score_correction_bias"):  # zeros at init: make it steer routing
                    tensor.copy_(torch.randn_like(tensor) * 0.5)
            for norm in (mtp.enorm, mtp.hnorm, mtp.head_norm, hf.model.norm):  # ones at init: make them matter
                norm.weight.copy_(1 + 0.3 * torch.randn_like(norm.weight))
        hf.save_pretrained(str(path))
        extra = mtp.hf_tensors(
            f"model.layers.{cfg.num_hidden_layers}.", hf.model.embed_tokens.weight, hf.lm_head.weight
        )
        save_file(extra, str(path / "mtp.safetensors"))
    return hf, mtp


@torch.no_grad()
def converted_tiny_deepseek_with_mtp(tmp: Path, vocab_size: int):
    """(HF model, reference MTP, tmp): the tiny model written to tmp/hf, converted to tmp/mcore."""
    from moe_sft.conversion.convert import convert

    hf, ref = write_tiny_deepseek_with_mtp(tmp / "hf", vocab_size)
    convert(tmp / "hf", tmp / "mcore")
    return hf, ref, tmp


def reference_logits(hf, mtp: ReferenceMTP, doc: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(main logits [T, V], MTP logits [T - 1, V]) of one document, run alone."""
    captured = {}
    hook = hf.model.norm.register_forward_hook(
        lambda module, args, out: captured.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    device = hf.lm_head.weight.device
    with cpu_compat.suspended():
        try:
            main = hf(torch.tensor([doc], device=device)).logits[0]
        finally:
            hook.remove()
        h = captured["h"][:, :-1]  # position i, for i < T - 1
        nxt = hf.model.embed_tokens(torch.tensor([doc[1:]], device=device))
        x = mtp.eh_proj(torch.cat([mtp.enorm(nxt), mtp.hnorm(h)], dim=-1))
        positions = torch.arange(x.shape[1], device=device)[None]
        out = mtp.layer(
            x, attention_mask=None, position_ids=positions, position_embeddings=hf.model.rotary_emb(x, positions)
        )
        out = out[0] if isinstance(out, tuple) else out
        return main.float(), hf.lm_head(mtp.head_norm(out))[0].float()
