"""The permutation of dropless top-k routing in one Triton pass (CUDA): every routed row's token,
each token's rows by slot, and where each row's probability lies in the [tokens, experts] probs.

moe_sft/kernels/permute.py orders the rows of a routing map with exactly k experts per token as
megatron does (expert-major, tokens ascending) with torch ops of static size: a cumsum, an argsort
of the flattened map, index arithmetic, an index_copy_ to invert it, the probabilities' gather and
a device-side check: about 20 kernels per MoE layer and micro-batch, each one a host launch in a
host-bound step (docs/benchmarks.md). Here: one cumsum of the transposed map (torch), then one kernel
that puts row (t, e) at start[e] + (tokens before t routed to e), with start the exclusive prefix
sum of the experts' counts, and writes the three outputs; the probabilities are then one
index_select (autograd carries their gradient back to the router). A token with another count
than k trips a device-side assert, as before.
"""

from __future__ import annotations

import torch

from moe_sft.kernels.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel ships no Triton
    triton = None

MAX_EXPERTS = 1024

if triton is not None:

    @triton.jit(do_not_specialize=["tokens"])  # one compile for every micro-batch's token count
    def _topk_rows_kernel(
        map_ptr,
        cum_ptr,
        rows_ptr,
        slot_rows_ptr,
        sources_ptr,
        bad_ptr,
        tokens,
        experts,
        K: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        token = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, BLOCK_E)
        real = col < experts
        inside = (token[:, None] < tokens) & real[None, :]
        token64 = token.to(tl.int64)[:, None]
        offset = token64 * experts + col[None, :]
        chosen = (tl.load(map_ptr + offset, mask=inside, other=0) != 0) & inside
        by_expert = col.to(tl.int64)[None, :] * tokens + token64  # cum is [experts, tokens]
        earlier = tl.load(cum_ptr + by_expert, mask=inside, other=0) - 1  # tokens before t routed to e
        counts = tl.load(cum_ptr + col.to(tl.int64) * tokens + tokens - 1, mask=real, other=0)
        start = tl.cumsum(counts, axis=0) - counts  # each expert's first row
        row = (start[None, :] + earlier).to(tl.int64)
        slot = tl.cumsum(chosen.to(tl.int32), axis=1) - 1  # j-th chosen expert of t
        ok = tl.sum(chosen.to(tl.int32), axis=1) == K
        write = chosen & ok[:, None] & (slot < K)
        tl.store(rows_ptr + row, token64 + tl.zeros_like(row), mask=write)
        tl.store(slot_rows_ptr + token64 * K + slot, row, mask=write)
        tl.store(sources_ptr + row, offset, mask=write)
        tl.atomic_max(bad_ptr, tl.max(((~ok) & (token < tokens)).to(tl.int32), axis=0))


def fits(routing_map: torch.Tensor) -> bool:
    return triton is not None and routing_map.is_cuda and 0 < routing_map.shape[1] <= MAX_EXPERTS


def topk_rows(routing_map: torch.Tensor, probs, k: int):
    """(rows [T*k] int64, slot_rows [T, k] int64, row probs [T*k] or None) for a [T, E] routing map
    with k experts per token: permute.py's `_rows_and_slots_known` (exactly k) and `_slot_rows` in one pass."""
    rows, slot_rows, sources, bad = unchecked_topk_rows(routing_map, k)
    # Checked on the device (no wait): a token with another count would shift every later row.
    torch._assert_async(bad == 0, "moe_sft permute: a token without exactly top-k experts")
    row_probs = probs.reshape(-1).index_select(0, sources) if probs is not None else None
    return rows, slot_rows, row_probs


def unchecked_topk_rows(routing_map: torch.Tensor, k: int):
    """(rows, slot_rows, sources: each row's flat index t * E + e in the routing map, a [1] int32
    flag: 1 if a token has another count than k); no assert."""
    tokens, experts = routing_map.shape
    routed = (routing_map if routing_map.dtype == torch.bool else routing_map.bool()).contiguous()
    # Each expert's running count over the tokens, scanned along the contiguous dim: torch's scan
    # along dim 0 of the [tokens, experts] map runs one thread per expert through all the tokens,
    # which was a visible share of the step (docs/log.md).
    cum = torch.cumsum(routed.t().contiguous(), dim=1, dtype=torch.int32)
    rows = torch.empty(tokens * k, dtype=torch.long, device=routed.device)
    slot_rows = torch.empty(tokens, k, dtype=torch.long, device=routed.device)
    sources = torch.empty(tokens * k, dtype=torch.long, device=routed.device)
    bad = torch.zeros(1, dtype=torch.int32, device=routed.device)
    block_e = triton.next_power_of_2(experts)
    per_program = max(1, 2048 // block_e)
    launch(
        _topk_rows_kernel,
        (triton.cdiv(tokens, per_program),),
        routed.view(torch.int8),
        cum,
        rows,
        slot_rows,
        sources,
        bad,
        tokens,
        experts,
        K=k,
        ROWS=per_program,
        BLOCK_E=block_e,
    )
    return rows, slot_rows, sources, bad
