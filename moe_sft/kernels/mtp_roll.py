"""MTP's packed-sequence roll (the next-next-token targets) by one gather, for context parallel size 1.

megatron-core's `_roll_tensor_packed_seq` loops over the documents with device indices in Python
slices: two host syncs per document, ~800 per step of the DeepSeek-V3 reduced benchmark (its
host-sync census). `roll_packed_left` computes the same values with one gather.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import multi_token_prediction

from moe_sft.runtime import patches

_megatron_roll_packed = patches.original(multi_token_prediction, "_roll_tensor_packed_seq")


def roll_packed_left(tensor, shifts, dims, packed_seq_params, cp_group=None):
    """megatron's `_roll_tensor_packed_seq` (same arguments and result: every document's values one
    place to the left, 0 at its last position); other rolls and CP > 1 go to megatron's."""
    if (cp_group is not None and cp_group.size() > 1) or shifts != -1 or dims not in (-1, tensor.dim() - 1):
        return _megatron_roll_packed(tensor, shifts, dims, packed_seq_params, cp_group)
    cu_seqlens = packed_seq_params.cu_seqlens_q.long()
    length = tensor.shape[-1]
    index = torch.arange(length, device=tensor.device)
    ends = torch.zeros(length + 1, dtype=torch.bool, device=tensor.device).index_fill_(0, cu_seqlens[1:], True)
    last_of_document = ends[1:]  # position j ends a document when j + 1 is a boundary
    rolled = tensor.index_select(-1, (index + 1).clamp_(max=length - 1))
    rolled = rolled.masked_fill(last_of_document, 0)
    # positions past the last document are left as they are, as megatron does
    rolled = torch.where(index >= cu_seqlens[-1], tensor, rolled)
    return rolled, rolled.sum()


def use_sync_free_roll() -> None:
    """megatron's `roll_tensor` looks the packed-sequence function up in its module at each call."""
    patches.swap(
        multi_token_prediction,
        "_roll_tensor_packed_seq",
        roll_packed_left,
        group=patches.KERNELS,
        reason="MTP packed roll without host syncs",
    )
