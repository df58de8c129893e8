"""Run GPTModel on packed (THD) documents: the one forward path used by training, eval and verify."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_sft.layers.packed import HostPackedSeqParams


def packed_seq_params(
    cu_seqlens: torch.Tensor, max_seqlen: int, cu_seqlens_host: torch.Tensor | None = None
) -> HostPackedSeqParams:
    """THD params for documents bounded by `cu_seqlens`; `cu_seqlens_host`, the same bounds on the
    CPU where the caller has them (a CPU `cu_seqlens` is its own)."""
    cu = cu_seqlens.to(torch.int32)
    if cu_seqlens_host is None and cu.device.type == "cpu":
        cu_seqlens_host = cu
    return HostPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
        cu_seqlens_host=None if cu_seqlens_host is None else cu_seqlens_host.to(torch.int32),
    )


def packed_batch(docs: Sequence[Sequence[int]], device="cpu"):
    """tokens [1, T], position_ids [1, T], PackedSeqParams for documents laid end to end."""
    lengths = [len(d) for d in docs]
    tokens = torch.tensor([t for d in docs for t in d], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    return tokens[None], positions[None], packed_seq_params(cu, max(lengths))


@torch.no_grad()
def packed_logits(model, docs: Sequence[Sequence[int]], vocab_size: int, device="cpu") -> list[torch.Tensor]:
    """Logits [len(doc), vocab_size] per document from one packed forward (PP=1 model)."""
    tokens, positions, params = packed_batch(docs, device)
    logits = model(input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params)
    logits = logits.reshape(-1, logits.shape[-1])[:, :vocab_size].float()
    return list(torch.split(logits, [len(d) for d in docs]))
