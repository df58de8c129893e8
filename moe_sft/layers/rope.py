"""Rotary embedding of packed (THD) sequences without host syncs, for context parallel size 1.

megatron-core 0.16.1's unfused `_apply_rotary_pos_emb_thd` reads the document lengths on the host
(`cu_seqlens.tolist()`, a tensor comparison in an `if`, `.item()` per document) to slice the
frequencies document by document. That is two to three host syncs per attention layer and
micro-batch: 272 per step of the Qwen3-30B-A3B-shape benchmark at 4096 tokens, each one letting
the GPU run dry (tools/benchmark.py's host-sync census, docs/benchmarks.md).

The slices it concatenates are, token by token, `freqs[position of the token in its document]`
(or `freqs[token index]` when `freqs` already has one row per packed token, which megatron
detects as `freqs.size(0) == cu_seqlens[-1]`; the split requires `cu_seqlens[-1] == tokens`, so
that is a host-side size test). Those positions come from `cu_seqlens` on the device, so one
gather replaces the loop. Context parallel keeps megatron's version (its per-rank halves).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

_megatron_rope_thd = rope_utils._apply_rotary_pos_emb_thd


def positions_in_documents(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Index of every packed token inside its document (segment of cu_seqlens), on the device."""
    tokens = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # the last segment start <= token (empty segments share a start: right=True skips them)
    segment = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    return (tokens - cu_seqlens.index_select(0, segment)).long()


def apply_rope_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
                   cp_group=None):
    """megatron's `_apply_rotary_pos_emb_thd` (same arguments, same result)."""
    if cp_group is None or cp_group.size() != 1:
        return _megatron_rope_thd(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                                  multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
    num_tokens = t.shape[0]
    if freqs.size(0) == num_tokens:  # one row per packed token already
        freqs_packed = freqs[:num_tokens]
    else:
        freqs_packed = freqs.index_select(0, positions_in_documents(cu_seqlens, num_tokens))
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), freqs_packed, rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)


def use_sync_free_rope() -> None:
    """megatron's `apply_rotary_pos_emb` looks the THD function up in its module at each call."""
    rope_utils._apply_rotary_pos_emb_thd = apply_rope_thd
