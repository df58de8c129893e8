"""Context-parallel sharding of packed THD micro-batches (inside the train step).

Each document of a micro-batch is padded to a multiple of 2·cp and cut into 2·cp chunks; CP rank
r keeps chunks r and 2·cp-1-r (megatron / Transformer Engine's load-balanced split, see
moe_sft/layers/context_parallel.py). Tokens, labels, loss mask, padding mask and position ids
are cut by the same index, so every token keeps its label and its original position within its
document.

Padding: the data loader's trailing padding segment (for PP / allgather-EP shapes) is dropped;
each document gets 0..2·cp-1 pad tokens appended inside its own segment, and one trailing pad
segment brings the total to a multiple of 2·cp·tp (sequence parallel splits each rank's T/cp
tokens over TP) or to the step's common length when shapes must match across ranks. Pad tokens
have mask 0, label 0 and are flagged in megatron's padding_mask (not routed, not in the aux
loss); causal attention keeps real tokens from seeing the pads that follow them. Pads use token
id 0, which is what megatron's MTP roll fills past a document's end, so MTP inputs match cp=1.

Rope: megatron 0.16.1's `_apply_rotary_pos_emb_thd` with a cp group of size cp takes each
global segment length L from cu_seqlens and gives the rank's rows the frequencies of positions
[r·L/2cp, (r+1)·L/2cp) and [(2cp-1-r)·L/2cp, (2cp-r)·L/2cp) of the segment
(`_get_thd_freqs_on_this_cp_rank`): exactly this split, so the packed_seq_params carry the
global padded cu_seqlens and the rope needs nothing else (tests/cpu/test_context_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_sft.data.packing import PackedMicroBatch, document_spans
from moe_sft.layers.context_parallel import CPAttentionPlan, CPPackedSeqParams, local_token_index, plan_cp_attention
from moe_sft.runtime.device import host_to_device


@dataclass
class CPShard:
    """One CP rank's share of a packed micro-batch; cu_seqlens stay global (megatron's convention)."""

    tokens: torch.Tensor  # [T/cp] int64
    labels: torch.Tensor  # [T/cp] int64
    loss_mask: torch.Tensor  # [T/cp] float32
    position_ids: torch.Tensor  # [T/cp] int64, original position within the (padded) document
    padding: torch.Tensor  # [T/cp] bool, True for pad tokens
    cu_seqlens: torch.Tensor  # [n+1] int32, global, every segment a multiple of 2·cp
    max_seqlen: int
    plan: CPAttentionPlan

    def to_device(self, device: str) -> dict:
        cu = host_to_device(self.cu_seqlens, device)
        params = CPPackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
            cp_plan=self.plan.to(device),
            cu_seqlens_host=self.cu_seqlens,
        )
        # The padding mask is passed even when this rank has no pads: megatron's router counts
        # tokens differently with and without it, and all CP/TP ranks must agree.
        return dict(
            tokens=host_to_device(self.tokens[None], device),
            labels=host_to_device(self.labels[None], device),
            loss_mask=host_to_device(self.loss_mask[None], device),
            position_ids=host_to_device(self.position_ids[None], device),
            params=params,
            padding=host_to_device(self.padding[None], device),
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_length(mb: PackedMicroBatch, cp: int, multiple: int) -> int:
    """Tokens after CP padding: documents to 2·cp, the total to `multiple` (a multiple of 2·cp)."""
    return _round_up(sum(_round_up(n, 2 * cp) for _, n in document_spans(mb)), multiple)


def pad_for_context_parallel(mb: PackedMicroBatch, cp: int, total: int):
    """(tokens, labels, loss_mask, position_ids, padding, cu_seqlens) of the full padded sequence."""
    src, segments, pos = [], [], []
    for start, n in document_spans(mb):
        padded = _round_up(n, 2 * cp)
        src.append(torch.cat([torch.arange(start, start + n), torch.full((padded - n,), -1)]))
        pos.append(torch.arange(padded))
        segments.append(padded)
    rest = total - sum(segments)
    if rest < 0:
        raise ValueError(f"micro-batch needs {sum(segments)} tokens after CP padding, more than {total}")
    if rest:
        src.append(torch.full((rest,), -1))
        pos.append(torch.arange(rest))
        segments.append(rest)
    index = torch.cat(src)
    pad = index < 0
    take = index.clamp(min=0)
    tokens = mb.tokens[take].masked_fill(pad, 0)
    labels = mb.labels[take].masked_fill(pad, 0)
    loss_mask = mb.loss_mask[take].masked_fill(pad, 0.0)
    cu = torch.tensor([0] + segments, dtype=torch.int64).cumsum(0).to(torch.int32)
    return tokens, labels, loss_mask, torch.cat(pos), pad, cu


def shard_micro_batch(mb: PackedMicroBatch, cp: int, rank: int, total: int) -> CPShard:
    """CP rank `rank`'s share of `mb`, padded to `total` tokens (see padded_length)."""
    tokens, labels, loss_mask, positions, pad, cu = pad_for_context_parallel(mb, cp, total)
    bounds = cu.tolist()
    keep = local_token_index(bounds, cp, rank)
    max_seqlen = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    return CPShard(
        tokens[keep],
        labels[keep],
        loss_mask[keep],
        positions[keep],
        pad[keep],
        cu,
        max_seqlen,
        plan_cp_attention(bounds, cp, rank),
    )


def shard_micro_batches(
    micro_batches, cp: int, rank: int, tp_for_sp: int, fixed_shape: bool, device: str
) -> tuple[list[CPShard], int]:
    """This CP rank's shards of a step's micro-batches, and the packed length to give the schedule.

    With `fixed_shape` (pipeline p2p, allgather expert dispatch) every micro-batch of every rank
    gets the step's longest padded length (one all-reduce of an int).
    """
    multiple = 2 * cp * tp_for_sp
    lengths = [padded_length(mb, cp, multiple) for mb in micro_batches]
    target = max(lengths, default=multiple)
    if fixed_shape:
        longest = torch.tensor([target], dtype=torch.long, device=device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        target = int(longest.item())
        lengths = [target] * len(lengths)
    shards = [shard_micro_batch(mb, cp, rank, n) for mb, n in zip(micro_batches, lengths)]
    return shards, target
