"""The pieces of Gemma 4's math that megatron has no function for, as pure torch functions the
Gemma 4 layer modules (router, attention; docs/log.md, issue 45) are built on. Each computes
exactly what transformers 5.24's models/gemma4/modeling_gemma4.py does (the reference), in the
same order and dtypes, and is tested against it (tests/cpu/test_gemma4.py).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma4RMSNorm: fp32, x * (mean(x²) + eps) ** -0.5 (torch.pow, as transformers writes it),
    times the weight (`x * w`, not Gemma 3's `1 + w`) where it has one, rounded once."""
    x32 = x.float()
    out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


def router_input(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma4TextRouter before its projection: the scale-free norm, times the learned `scale` and
    hidden_size ** -0.5."""
    return rms_norm(x, eps) * scale * x.shape[-1] ** -0.5


def scaled_topk(logits: torch.Tensor, per_expert_scale: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma4TextRouter's routing as megatron's router returns it: (probs [tokens, experts], zero
    outside the chosen; routing_map [tokens, experts] bool). Softmax over all experts in fp32,
    top-k, renormalised to sum 1, then each weight times its expert's `per_expert_scale`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, index = torch.topk(probs, k=topk, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * per_expert_scale[index]
    dense = torch.zeros_like(probs).scatter(-1, index, weights)
    routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, index, True)
    return dense, routing_map


def proportional_inv_freq(head_dim: int, theta: float, partial_rotary_factor: float, factor: float = 1.0):
    """transformers' `proportional` RoPE (Gemma 4's full layers): the first
    int(partial_rotary_factor * head_dim // 2) frequency pairs θ^(-2j / head_dim) — over the whole
    head's width, unlike megatron's rotary_percent — and zero (no rotation) for the others."""
    rotated = int(partial_rotary_factor * head_dim // 2)
    inv = 1.0 / (theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim))
    inv = torch.cat([inv, torch.zeros(head_dim // 2 - rotated)])
    return inv / factor


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """transformers' default RoPE over the whole head (Gemma 4's sliding layers)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def rotary_freqs(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Angles [S, 1, 1, D] in megatron's layout (the two halves equal) for positions [S]:
    megatron's apply_rotary_pos_emb then rotates each channel j with channel j + D/2 over the whole
    head, which is transformers' rotate_half — also for the zero frequencies of proportional RoPE."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


def split_qkv(mixed: torch.Tensor, groups: int, head_dim: int, k_eq_v: bool):
    """linear_qkv's output [..., G*(R+2)*D] (per group: R queries, key, value) or, for a k-eq-v
    layer, [..., G*(R+1)*D] (queries, key) → q [..., G*R, D], k [..., G, D], v [..., G, D]; a k-eq-v
    layer's V is its K as projected (transformers takes it before k_norm and RoPE)."""
    per_group = mixed.reshape(*mixed.shape[:-1], groups, -1, head_dim)
    kv = 1 if k_eq_v else 2
    q, k, *v = torch.split(per_group, [per_group.shape[-2] - kv] + [1] * kv, dim=-2)
    q = q.reshape(*mixed.shape[:-1], -1, head_dim)
    k = k.squeeze(-2)
    return q, k, (k if k_eq_v else v[0].squeeze(-2))
