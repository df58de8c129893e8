"""Context-parallel (CP) core attention on packed THD documents: all-gather K/V, varlen kernels.

Layout (megatron / Transformer Engine's load-balanced split, made by moe_sft.trainer.cp_sharding):
every document (cu_seqlens segment, padded to a multiple of 2·cp) is cut into 2·cp equal chunks
of c tokens; CP rank r holds chunks r and 2·cp-1-r, in that order, for each document in turn.
Under a causal mask chunk i costs ~(i+1)·c² of attention, so every rank does (2·cp+1)·c²: the
causal work is balanced (a contiguous split would leave rank cp-1 with 2·cp-1 times rank 0's work).

The computation on rank r, per document of length L = 2·cp·c:
  1. all-gather the local K/V rows over the CP group (K and V concatenated: one collective);
     backward is the reduce-scatter of dK/dV (`_AllGatherRows`);
  2. pick, with one index_select, each query chunk's causal key prefix in document order:
     chunk r needs keys [0, (r+1)·c), chunk 2·cp-1-r needs keys [0, (2·cp-r)·c);
  3. one varlen call over the 2·n (query chunk, key prefix) pairs with separate cu_seqlens_q /
     cu_seqlens_k and a bottom-right aligned causal mask (query i of a chunk starting at o sees
     keys 0..o+i, i.e. the last query row sees the whole prefix).
The chunks' outputs land in the rank's local token order, so nothing is permuted back.

Why all-gather K/V and not a ring of p2p steps (TE's default "p2p" cp_comm_type): the ring keeps
only two K/V blocks in flight and overlaps each send/recv with a partial attention kernel, but it
needs 2·cp partial kernels per layer whose results are merged with log-sum-exp corrections (in
forward and backward) and per-step kernels on short chunks, which is slow for SFT-length
documents. One all-gather (one collective: K and V concatenated) plus one varlen kernel per layer
is exact with the same kernel as cp=1 and has no merging. The communication volume is the
ring's: each rank receives (cp-1)/cp of the micro-batch's K/V in forward and reduce-scatters the
same amount of dK/dV in backward. The cost is memory and overlap: the kernel's inputs, the K/V key prefixes
picked from the gathered rows (cp + 1/2 times the rank's own K/V), are saved for backward like
any activation, in every layer (the ring saves only the local K/V and re-sends in backward), and
the collective is not overlapped with compute.
With GQA, K/V are h_q/h_kv times smaller than Q, which keeps this cheap; megatron-LM's
"all_gather" cp_comm_type makes the same trade.

Gated DeltaNet (linear attention, moe_sft/layers/gated_delta_net.py) cannot use this: its causal
convolution and recurrent state run along the whole document, token after token. Its heads are
independent, so an all-to-all over the CP group trades "my tokens, all heads" for "all tokens,
my heads" (`heads_to_sequences`): CP rank j receives head group j of every rank's tokens, stacked
rank-major, and `document_order` puts them back into the packed sequence's order (undoing the
chunk pairing), so each rank runs the convolution and the delta rule on whole documents for
1/cp of the heads; `sequences_to_heads` is the way back. Equal-split all-to-all is its own
adjoint, so the backward is the same collective on the gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_sft.layers.packed import HostPackedSeqParams
from moe_sft.runtime.device import host_to_device

# kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale) -> out [tq, hq, dv];
# causal, bottom-right aligned (flash-attn's convention for seqlen_q < seqlen_k).
Kernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class CPAttentionPlan:
    """Index tensors for one micro-batch on one CP rank (shared by every layer)."""

    kv_index: torch.Tensor  # [Tk] int64: rows of the all-gathered (rank-major) K/V, per key prefix
    cu_seqlens_q: torch.Tensor  # [2n+1] int32: this rank's query chunks (its local token order)
    cu_seqlens_k: torch.Tensor  # [2n+1] int32: their causal key prefixes within kv_index
    max_seqlen_q: int
    max_seqlen_k: int
    # [T] int64 each, the same on every rank (Gated DeltaNet's head all-to-all, below):
    document_order: torch.Tensor  # rows of the rank-major stacked tokens, in packed-sequence order
    rank_order: torch.Tensor  # its inverse: rows of the packed sequence, rank-major

    def to(self, device) -> CPAttentionPlan:
        move = lambda t: host_to_device(t, device)  # noqa: E731
        return CPAttentionPlan(
            move(self.kv_index),
            move(self.cu_seqlens_q),
            move(self.cu_seqlens_k),
            self.max_seqlen_q,
            self.max_seqlen_k,
            move(self.document_order),
            move(self.rank_order),
        )


@dataclass
class CPPackedSeqParams(HostPackedSeqParams):
    """megatron's PackedSeqParams (global, padded cu_seqlens: what its THD rope expects with CP)
    plus the attention plan, built once per micro-batch on the host instead of once per layer."""

    cp_plan: CPAttentionPlan | None = None


def chunk_owner(chunk: torch.Tensor, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, half) holding chunk i of 2·cp: i < cp → rank i, first half; else rank 2cp-1-i, second."""
    late = chunk >= cp
    return torch.where(late, 2 * cp - 1 - chunk, chunk), late.long()


def plan_cp_attention(cu_seqlens: Sequence[int], cp: int, rank: int) -> CPAttentionPlan:
    """The plan for CP rank `rank` of a micro-batch whose global (padded) segments are `cu_seqlens`.

    Every segment length must be a multiple of 2·cp. The all-gathered K/V is rank-major: rows
    [j·T_local, (j+1)·T_local) are rank j's local rows, where each document d (global start s_d)
    occupies local rows [s_d/cp, s_d/cp + 2c_d): chunk j then chunk 2cp-1-j. The same rows, taken
    in document order for every segment, are `document_order` (Gated DeltaNet's all-to-all).
    """
    bounds = [int(x) for x in cu_seqlens]
    if bounds[-1] % cp:
        raise ValueError(f"packed length {bounds[-1]} is not a multiple of context_parallel_size={cp}")
    local_total = bounds[-1] // cp
    rows, q_lens, k_lens, order = [], [], [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length % (2 * cp):
            raise ValueError(
                f"segment [{start}, {end}) of length {length} is not a multiple of "
                f"2*context_parallel_size={2 * cp}; pad documents for CP first"
            )
        if length == 0:
            continue
        c = length // (2 * cp)
        pos = torch.arange(length)
        owner, half = chunk_owner(pos // c, cp)
        full = owner * local_total + start // cp + half * c + pos % c  # the document in order
        order.append(full)
        for chunk in (rank, 2 * cp - 1 - rank):
            keys = (chunk + 1) * c
            rows.append(full[:keys])
            q_lens.append(c)
            k_lens.append(keys)
    cu = lambda lens: torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    document_order = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    rank_order = torch.empty_like(document_order)
    rank_order[document_order] = torch.arange(len(document_order))
    return CPAttentionPlan(
        torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long),
        cu(q_lens),
        cu(k_lens),
        max(q_lens, default=0),
        max(k_lens, default=0),
        document_order,
        rank_order,
    )


def local_token_index(cu_seqlens: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Indices into the full (padded) packed sequence of the tokens CP rank `rank` keeps, in order."""
    bounds = [int(x) for x in cu_seqlens]
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        c = (end - start) // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class _AllGatherRows(torch.autograd.Function):
    """All-gather along dim 0 (rank-major); backward reduce-scatters the gradient (sums every
    rank's contribution to this rank's rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_gather_kv(k: torch.Tensor, v: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every CP rank (rank-major rows) in one collective."""
    dk = k.shape[-1]
    gathered = _AllGatherRows.apply(torch.cat([k, v], dim=-1), group)
    return gathered[..., :dk], gathered[..., dk:]


def sdpa_bottom_right(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    """Reference kernel: per (query, key) segment pair, SDPA with a bottom-right causal mask.

    torch's `is_causal=True` is top-left aligned (query i sees keys 0..i), which is wrong when a
    query chunk sits at the end of a longer key prefix; the explicit mask lets query i see keys
    0..i + (sk - sq).
    """
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    groups = q.shape[1] // k.shape[1]
    qb, kb = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for qs, qe, ks, ke in zip(qb[:-1], qb[1:], kb[:-1], kb[1:]):
        sq, sk = qe - qs, ke - ks
        if sq == 0:
            continue
        rows, cols = torch.arange(sq, device=q.device), torch.arange(sk, device=q.device)
        mask = cols[None, :] <= rows[:, None] + (sk - sq)
        qd = q[qs:qe].transpose(0, 1)
        kd = k[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)
        vd = v[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)
        out[qs:qe] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


def attention_on_gathered_kv(
    q, k_all, v_all, plan: CPAttentionPlan, scale: float, kernel: Kernel = sdpa_bottom_right
) -> torch.Tensor:
    """This rank's attention output [t_local, hq, dv] given every rank's K/V (rank-major rows).

    Pure (no communication): the unit tests feed it K/V gathered by hand to simulate cp ranks.
    """
    k = k_all.index_select(0, plan.kv_index)
    v = v_all.index_select(0, plan.kv_index)
    return kernel(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k, scale)


def context_parallel_attention(
    q, k, v, plan: CPAttentionPlan, scale: float, group, kernel: Kernel = sdpa_bottom_right
) -> torch.Tensor:
    """CP attention of the local q/k/v rows ([t_local, heads, dim]) over the CP `group`."""
    k_all, v_all = all_gather_kv(k, v, group)
    return attention_on_gathered_kv(q, k_all, v_all, plan, scale, kernel)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 ([cp, ...]: block j goes to rank j, block r of the
    output came from rank r). Its adjoint is the same all-to-all, so backward repeats it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()  # first: empty_like keeps a view's strides, all_to_all_single writes linearly
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def received_to_sequences(received: torch.Tensor, plan: CPAttentionPlan) -> torch.Tensor:
    """[cp, T_local, w] (block r: rank r's tokens, this rank's head group) → [T, w] in the packed
    sequence's order. Pure: the unit tests feed it blocks exchanged by hand."""
    return received.reshape(-1, received.shape[-1]).index_select(0, plan.document_order)


def sequences_to_sent(x: torch.Tensor, plan: CPAttentionPlan, cp: int) -> torch.Tensor:
    """[T, w] in the packed sequence's order → [cp, T_local, w] (block r: rank r's tokens, in its
    local order). Pure: the inverse of received_to_sequences."""
    return x.index_select(0, plan.rank_order).reshape(cp, -1, x.shape[-1])


def heads_to_sequences(x: torch.Tensor, plan: CPAttentionPlan, group) -> torch.Tensor:
    """This rank's tokens with every head group, [T_local, cp, w] (group j: the channels CP rank j
    will own) → every token of the micro-batch with this rank's head group, [T, w], in order."""
    return received_to_sequences(_AllToAll.apply(x.transpose(0, 1), group), plan)


def sequences_to_heads(x: torch.Tensor, plan: CPAttentionPlan, group) -> torch.Tensor:
    """The inverse of heads_to_sequences: [T, w] (this rank's head group) → [T_local, cp, w]
    (this rank's tokens, head group j from CP rank j)."""
    cp = dist.get_world_size(group)
    return _AllToAll.apply(sequences_to_sent(x, plan, cp), group).transpose(0, 1)
