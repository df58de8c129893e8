"""Tiny Qwen3-Next / Qwen3.5 MoE HF checkpoints *with* the releases' MTP module, and a reference MTP forward.

transformers' Qwen3NextForCausalLM / Qwen3_5MoeForCausalLM neither load nor run the releases'
`mtp.*` tensors, so the test writes them itself in the released layout and computes the MTP logits
as vLLM's Qwen3NextMultiTokenPredictor / Qwen3_5MultiTokenPredictor define them, from
transformers' own decoder-layer and (zero-centred) RMSNorm modules:

    x_i = fc(cat(pre_fc_norm_embedding(Emb(t_{i+1})), pre_fc_norm_hidden(h_i)))
    logits_i = lm_head(norm(Layer(x_i)))

where h_i is the main model's output after its final norm (vLLM's target hidden states), `Layer`
a decoder layer with full (gated) attention and the MoE block, and logits_i predicts t_{i+2}.
The main embedding and lm_head are shared: the release stores no copies.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

from moe_sft.models import registry
from moe_sft.runtime import cpu_compat
from tests.deepseek_mtp import decoder_layer_tensors

MODULES = {
    "qwen3_next": (Qwen3NextDecoderLayer, Qwen3NextRMSNorm),
    "qwen3_5_moe": (Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm),
}


class QwenReferenceMTP(torch.nn.Module):
    def __init__(self, family: str, cfg):
        super().__init__()
        layer_class, norm = MODULES[family]
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = norm(h, eps)
        self.pre_fc_norm_hidden = norm(h, eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        # transformers' decoder layer picks its mixer from layer_types[layer_idx]: the MTP layer,
        # index N, is a full-attention layer (vLLM builds it with layer_type="full_attention").
        layer_cfg = copy.deepcopy(cfg)
        layer_cfg.layer_types = list(cfg.layer_types) + ["full_attention"]
        self.layer = layer_class(layer_cfg, cfg.num_hidden_layers)
        self.norm = norm(h, eps)

    def hf_tensors(self) -> dict:
        out = {
            "mtp.pre_fc_norm_embedding.weight": self.pre_fc_norm_embedding.weight,
            "mtp.pre_fc_norm_hidden.weight": self.pre_fc_norm_hidden.weight,
            "mtp.fc.weight": self.fc.weight,
            "mtp.norm.weight": self.norm.weight,
        }
        out.update(decoder_layer_tensors(self.layer, "mtp.layers.0."))
        return {k: v.detach().clone().contiguous() for k, v in out.items()}


@torch.no_grad()
def _perturb(hf, mtp, std: float) -> None:
    """Off the init values: a bare decoder layer holds torch.empty memory, and every norm sits at its
    init (zero-centred ones at 0, x * (1 + 0); the GDN's gated norm at 1): make every weight
    matter, the two pre-fc norms apart (swapping them must show)."""
    for param in mtp.parameters():
        if param.dim() >= 2:
            torch.nn.init.normal_(param, std=std)
    for name, tensor in list(hf.named_parameters()) + list(mtp.named_parameters()):
        if tensor.dim() == 1 and "norm" in name:
            tensor.add_(0.3 * torch.randn_like(tensor))


def write_tiny_with_mtp(family_name: str, path: Path, vocab_size: int, cfg=None, seed: int = 0, **overrides):
    """Save a tiny random model of the family with the release's MTP module (`mtp.*` in its own
    file, `mtp_num_hidden_layers: 1` in config.json); returns (HF model, reference MTP)."""
    family = registry.family_by_name(family_name)
    if cfg is None:
        cfg = family.tiny_hf_config(vocab_size=vocab_size, **overrides)
    cfg.mtp_num_hidden_layers = 1
    with cpu_compat.suspended():
        torch.manual_seed(seed)
        hf = family.hf_model_class(cfg).eval()
        mtp = QwenReferenceMTP(family_name, hf.config).eval()
        _perturb(hf, mtp, cfg.initializer_range)
        hf.save_pretrained(str(path))
        save_file(mtp.hf_tensors(), str(path / "mtp.safetensors"))
    return hf, mtp


def reference_logits(hf, mtp: QwenReferenceMTP, doc: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(main logits [T, V], MTP logits [T - 1, V]) of one document, run alone."""
    captured = {}
    norm_hook = hf.model.norm.register_forward_hook(
        lambda module, args, out: captured.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    # the rotary (cos, sin) the main model's layers get (Qwen3.5's multimodal rope for text
    # included); the MTP layer runs at the same positions, 0 .. T - 2
    rope_hook = hf.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: captured.__setitem__("rope", kwargs["position_embeddings"]), with_kwargs=True
    )
    device = hf.lm_head.weight.device
    with cpu_compat.suspended():
        try:
            main = hf(torch.tensor([doc], device=device)).logits[0]
        finally:
            norm_hook.remove()
            rope_hook.remove()
        h = captured["h"][:, :-1]  # position i, for i < T - 1
        nxt = hf.model.embed_tokens(torch.tensor([doc[1:]], device=device))
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(nxt), mtp.pre_fc_norm_hidden(h)], dim=-1))
        positions = torch.arange(x.shape[1], device=device)[None]
        cos, sin = captured["rope"]
        out = mtp.layer(x, position_embeddings=(cos[..., :-1, :], sin[..., :-1, :]), position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return main.float(), hf.lm_head(mtp.norm(out))[0].float()
