"""Token permutation for megatron's MoE token dispatchers, with no atomic adds.

megatron-core 0.16.1's unfused `permute` gathers each token's rows with `index_select`, whose
backward is an `index_add_`, and `unpermute` merges the rows with `scatter_add_`: both are atomic
adds of bf16 hidden vectors, one per (token, expert) row, a sizeable part of the benchmark's step
(docs/log.md).

Here every direction is a gather: slot j of a token names the row of its j-th expert, and the
combine sums each token's rows in slot order, reading them where they lie (on CUDA one Triton
pass, moe_sft/kernels/gather_sum.py; copying them into a dense [tokens, k, hidden] buffer first
was most of this phase's time: docs/log.md). The rows come out in megatron's
order (expert-major, tokens ascending), so the experts see exactly what they saw before, and the
sum is deterministic (an fp32-accumulated reduction over k values instead of k rounded atomic adds).

With EP x TP = 1 the alltoall dispatcher's `sort_chunks_by_idxs` reorders the chunks by the
identity permutation: it copies every row into the same place forward and backward. It is skipped.

No host syncs on the dropless path with EP x TP = 1. The alltoall dispatcher knows that every
token has exactly top-k rows (`num_out_tokens = tokens x k`); it tags that count (`TopKRows`),
and permute then orders the rows with a stable sort of static size instead of `masked_select`,
whose output size the host must wait for (three waits per MoE layer; with the packed rope's,
moe_sft/kernels/rope.py, and the batch copies' they left the GPU idle for part of every step:
docs/log.md). Nothing needs the per-expert counts on the host
either (torch's grouped_mm takes device offsets), so the dispatcher's device-to-host copy and its
wait are dropped too. With EP x TP > 1 the all-to-all split sizes need the host once per layer
anyway (megatron's one device-to-host copy and wait); the local permutation is static there too.

The allgather dispatcher (EP x expert-TP > 1) waits for the host five times per MoE layer in
megatron: the per-expert counts, the permutation's two `masked_select`s and its width, the local
probs' `masked_select`. Here it reads one number, the layer's local row count (`CountedRows`),
and every other size follows from it and from min(top-k, local experts).

Where a rank gathers few enough tokens for the host to be the limit (`Layout.static_rows`,
moe_sft/config/layout.py), or the MoE half is a CUDA graph, the allgather's local permutation has
no wait at all (`BoundedRows`, `enable_static_rows`): it always has the same row count, the routed rows first and
padding after them. Why: with one wait per MoE layer the GPU runs the rest of the layer at the
host's launch pace. Where the step is GPU-bound instead (more gathered tokens), the padding's
extra gather and activation traffic is what is left, hence the bound on gathered tokens (the
measured gains and losses: docs/log.md).

That count is the rank's worst case, tokens x min(top-k, local experts), capped at the capacity
(`model.moe_static_rows_capacity`, 2 by default) times its expected routed rows, tokens x top-k x
local / all experts. The worst case is EP x min(top-k, local) / top-k times the expected rows: 2x
at EP2, but 4x at EP4 and 8x at EP8 with top-8, whose activations the cap keeps to 2x. Routing
above the cap is possible there but not silent: the permutation keeps the first `capacity` rows,
the expert counts are cut to match, and the layer records the excess on the device
(`moe_sft_excess`); the trainer reads it once per step and runs the step again without static rows
(moe_sft/trainer/row_capacity.py). Nothing routed is ever dropped from an update.

What keeps the padding out of the results, and costs it nothing on CUDA: the grouped GEMMs and
the weight-gradient kernel stop at the last expert's offset, the row gather (forward, and the
combine's backward) and the experts' SwiGLU at the routed row count (kernels/bounded_rows.py);
the combine and the gather's backward read the routed rows only (a padding row's slot is a spare
one past the grid); and the padding's probs are 0 with their gradient masked, the one path by
which a padding row (whatever the GEMMs left in it) could reach the router. Off for experts with
biases or adapters, whose extra terms read every row.

A call with `fused=True` (TE's kernels, `moe_permute_fusion`) or drop-and-pad goes to megatron unchanged.
"""

from __future__ import annotations

import math

import torch
from megatron.core.tensor_parallel import reduce_scatter_to_sequence_parallel_region
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from moe_sft.kernels import bounded_rows, topk_rows
from moe_sft.kernels.gather_sum import gather_sum
from moe_sft.runtime import patches

_megatron_permute = moe_utils.permute
_megatron_unpermute = moe_utils.unpermute
_megatron_sort_chunks = moe_utils.sort_chunks_by_idxs


class TopKRows(int):
    """A row count of tokens x top-k where every token has exactly k rows (dropless top-k routing)."""


class CountedRows(int):
    """A row count read from the device, with `width`, the most rows any token may have: with both
    known on the host the permutation needs no other wait."""

    def __new__(cls, count: int, width: int):
        rows = super().__new__(cls, count)
        rows.width = width
        return rows


class BoundedRows(int):
    """The static row count of the allgather's local permutation: the routed rows first (megatron's
    order), then padding rows that no result reads. `width`: the most rows a token may have;
    `routed`: the routed row count on the device (0-dim), where the row-wise kernels stop
    (moe_sft/kernels/bounded_rows.py), or None to run them over every row."""

    def __new__(cls, count: int, width: int, routed: torch.Tensor | None = None):
        rows = super().__new__(cls, count)
        rows.width, rows.routed = width, routed
        return rows


STATIC_ROWS_CAPACITY = 2.0  # default cap of a rank's static rows, as a multiple of its expected routed rows


def _known_rows(routing_map: torch.Tensor, num_out_tokens) -> tuple[int, bool] | None:
    """(width, every token has exactly width rows) when the row count is known on the host, else None."""
    if not routing_map.shape[0]:
        return None
    if isinstance(num_out_tokens, TopKRows):
        return num_out_tokens // routing_map.shape[0], True
    if isinstance(num_out_tokens, CountedRows):
        return num_out_tokens.width, False
    return None


def _rows_and_slots_known(routing_map: torch.Tensor, num_rows: int, width: int, exact: bool):
    """`_rows_and_slots` for a routing map of num_rows routed places and at most `width` per token
    (exactly `width` when `exact`), every size known in advance: no host sync. Also returns the
    rows' flat (expert, token) places."""
    num_tokens = routing_map.shape[0]
    routed = routing_map.bool()
    if exact:  # checked on the device (no wait): a token with another count would shift every later row
        torch._assert_async(routed.sum(dim=1).eq(width).all(), "moe_sft permute: a token without exactly top-k experts")
    slots = routed.cumsum(dim=1, dtype=torch.int32) - 1
    by_expert = routed.T.reshape(-1)
    # Stable: the routed (expert, token) places first, expert-major and tokens ascending as megatron.
    flat = torch.argsort((~by_expert).to(torch.uint8), stable=True)[:num_rows]
    rows = flat % num_tokens
    row_slots = slots.T.reshape(-1).index_select(0, flat).long()
    return rows, rows * width + row_slots, flat


def _rows_and_slots(routing_map: torch.Tensor):
    """For a [tokens, experts] routing map: the token of every routed row in megatron's order
    (expert-major), the row's place in a [tokens, width] grid of slots (slot j of a token holds
    its j-th chosen expert's row), and width, the most rows any token has."""
    routed = routing_map.bool()
    slots = routed.cumsum(dim=1, dtype=torch.int32) - 1  # j-th chosen expert of the token → j
    by_expert = routed.T.contiguous()
    tokens = torch.arange(routed.shape[0], device=routed.device).unsqueeze(0).expand_as(by_expert)
    rows = tokens.masked_select(by_expert)
    row_slots = slots.T.contiguous().masked_select(by_expert).long()
    # masked_select has already waited for the GPU (its output size), so this read is cheap.
    width = max(int(slots[:, -1].max().item()) + 1, 1) if routed.numel() else 1
    return rows, rows * width + row_slots, width


def _slot_rows(places: torch.Tensor, num_tokens: int, width: int) -> torch.Tensor:
    """[tokens, width]: the row held by each slot (-1: an empty one), i.e. `places` inverted.
    A place of tokens x width (a padding row's) lands in a spare slot that is dropped."""
    slot_rows = torch.full((num_tokens * width + 1,), -1, dtype=torch.long, device=places.device)
    slot_rows.index_copy_(0, places, torch.arange(places.numel(), device=places.device))
    return slot_rows[:-1].view(num_tokens, width)


def _padded_rows(routing_map: torch.Tensor, probs, num_rows: int, width: int):
    """(rows, slot_rows, permuted probs) of `BoundedRows`: the routed (expert, token) places in
    megatron's order, then unrouted ones as padding (valid token ids, prob 0, spare slot)."""
    num_tokens = routing_map.shape[0]
    routed = routing_map.bool()
    slots = routed.cumsum(dim=1, dtype=torch.int32) - 1
    by_expert = routed.T.reshape(-1)
    flat = torch.argsort((~by_expert).to(torch.uint8), stable=True)[:num_rows]
    rows = flat % num_tokens
    real = by_expert.index_select(0, flat)
    places = rows * width + slots.T.reshape(-1).index_select(0, flat).long()
    slot_rows = _slot_rows(places.masked_fill(~real, num_tokens * width), num_tokens, width)
    permuted_probs = None
    if probs is not None:
        # where, not a product: the padding rows' gradient is whatever the GEMMs left there
        permuted_probs = torch.where(real, probs.T.reshape(-1).index_select(0, flat), 0)
    return rows, slot_rows, permuted_probs


def _merge_rows(rows_data: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
    """out[t] = sum of the rows of token t, read where they lie (moe_sft/kernels/gather_sum.py)."""
    return gather_sum(rows_data, slot_rows)


class _GatherRows(torch.autograd.Function):
    """Forward: x[rows] (up to the routed rows' bound, if any). Backward: a token's gradient is the
    sum of its rows' gradients."""

    @staticmethod
    def forward(ctx, x, rows, slot_rows, bound):
        ctx.save_for_backward(slot_rows)
        return bounded_rows.gather_rows(x, rows, bound)

    @staticmethod
    def backward(ctx, grad_rows):
        (slot_rows,) = ctx.saved_tensors
        return _merge_rows(grad_rows, slot_rows), None, None, None


class _MergeRows(torch.autograd.Function):
    """Forward: out[t] = sum of token t's rows. Backward: every row gets its token's gradient (up
    to the routed rows' bound, if any: a padding row's gradient is never read)."""

    @staticmethod
    def forward(ctx, rows_data, rows, slot_rows):
        bound = getattr(rows, "_moe_sft_bound", None)
        ctx.save_for_backward(rows, bound)
        return _merge_rows(rows_data, slot_rows)

    @staticmethod
    def backward(ctx, grad_out):
        rows, bound = ctx.saved_tensors
        return bounded_rows.gather_rows(grad_out, rows, bound), None, None


def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
    """megatron's `moe_utils.permute` (same arguments, same output order) without atomics."""
    if fused or drop_and_pad or tokens.dim() != 2:
        return _megatron_permute(
            tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused, drop_and_pad=drop_and_pad
        )
    permuted_probs, bound = None, None
    known = _known_rows(routing_map, num_out_tokens)
    if isinstance(num_out_tokens, BoundedRows):
        bound = num_out_tokens.routed
        rows, slot_rows, permuted_probs = _padded_rows(routing_map, probs, int(num_out_tokens), num_out_tokens.width)
    elif known and known[1] and topk_rows.fits(routing_map):  # exactly top-k, CUDA: one Triton pass
        rows, slot_rows, permuted_probs = topk_rows.topk_rows(routing_map, probs, known[0])
    else:
        if known:
            width = known[0]
            rows, places, flat = _rows_and_slots_known(routing_map, int(num_out_tokens), width, known[1])
            if probs is not None:
                permuted_probs = probs.T.reshape(-1).index_select(0, flat)
        else:
            rows, places, width = _rows_and_slots(routing_map)
            if probs is not None:
                permuted_probs = probs.T.contiguous().masked_select(routing_map.bool().T.contiguous())
        slot_rows = _slot_rows(places, tokens.shape[0], width)
    # megatron hands `rows` (its "sorted_indices") back to unpermute: the slots travel with it, so
    # the combine does not recompute them (another masked_select, i.e. another host sync).
    rows._moe_sft_slots = slot_rows
    rows._moe_sft_bound = bound
    permuted = _GatherRows.apply(tokens, rows, slot_rows, bound)
    # the experts' SwiGLU stops there too (moe_sft/layers/experts.py)
    permuted._moe_sft_rows_bound = bound
    return permuted, permuted_probs, rows


def unpermute(
    permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False, drop_and_pad=False
):
    """megatron's `moe_utils.unpermute` (same arguments) without atomics."""
    if fused or drop_and_pad or routing_map is None or len(restore_shape) != 2:
        return _megatron_unpermute(
            permuted_tokens,
            sorted_indices,
            restore_shape,
            probs=probs,
            routing_map=routing_map,
            fused=fused,
            drop_and_pad=drop_and_pad,
        )
    input_dtype = permuted_tokens.dtype
    rows = sorted_indices
    slot_rows = getattr(sorted_indices, "_moe_sft_slots", None)
    if slot_rows is None:
        _, places, width = _rows_and_slots(routing_map)
        slot_rows = _slot_rows(places, restore_shape[0], width)
    if probs is not None:  # as megatron: weight each row by its prob (may promote to fp32)
        permuted_probs = probs.T.contiguous().masked_select(routing_map.bool().T.contiguous())
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    merged = _MergeRows.apply(permuted_tokens, rows, slot_rows)
    return merged.to(input_dtype)


def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
    """megatron's `moe_utils.sort_chunks_by_idxs`, returning its input when the order is the identity."""
    order = sorted_idxs.tolist()
    if order == list(range(len(order))):
        return input, probs
    return _megatron_sort_chunks(input, split_sizes, sorted_idxs, probs=probs, fused=fused)


_megatron_alltoall_preprocess = patches.original(token_dispatcher.MoEAlltoAllTokenDispatcher, "preprocess")


def _alltoall_preprocess(self, routing_map):
    """megatron's preprocess; then the dropless row count is tagged as top-k exact, and with
    EP x TP = 1 the per-expert counts stay on the device (no copy to the host, no wait for it)."""
    # megatron only ever moves these points earlier; start each call from the constructor's
    self.cuda_dtoh_point, self.cuda_sync_point = getattr(
        self, "_moe_sft_sync_points", (self.cuda_dtoh_point, self.cuda_sync_point)
    )
    self._moe_sft_sync_points = (self.cuda_dtoh_point, self.cuda_sync_point)
    tokens_per_expert = _megatron_alltoall_preprocess(self, routing_map)
    dropless = (
        not self.drop_and_pad
        and self.config.moe_expert_capacity_factor is None
        and not self.config.moe_router_padding_for_quantization
    )
    if dropless and not self.config.moe_permute_fusion:
        # The local permutation has tokens x k rows at any EP / TP: no wait for its size.
        self.num_out_tokens = TopKRows(self.num_out_tokens)
        if self.ep_size == 1 and self.tp_size == 1:  # else the all-to-all needs its splits on the host
            self.cuda_dtoh_point = self.cuda_sync_point = "no_sync"  # a point never reached
    return tokens_per_expert


_megatron_allgather_postprocess = patches.original(token_dispatcher.MoEAllGatherTokenDispatcher, "dispatch_postprocess")


def _allgather_postprocess(self, hidden_states, probs):
    """megatron's allgather `dispatch_postprocess` (same outputs, same order) with one host wait,
    the count of the gathered tokens' rows for this rank's experts, or none with static rows. The
    per-expert counts stay on the device (torch's grouped_mm takes device offsets)."""
    if self.config.moe_permute_fusion:
        return _megatron_allgather_postprocess(self, hidden_states, probs)
    self.hidden_shape_before_permute = hidden_states.shape
    local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
    self.local_map = self.routing_map[:, local].contiguous()
    tokens_per_expert = self.local_map.sum(dim=0).long()
    width = min(self.router_topk, self.num_local_experts)
    if getattr(self, "moe_sft_static_rows", False):
        capacity = static_rows_count(hidden_states.shape[0], self, self.moe_sft_capacity)
        routed = tokens_per_expert.cumsum(0)
        if capacity < hidden_states.shape[0] * width:  # routing may exceed it: cut, and record by how much
            torch.maximum(self.moe_sft_excess, routed[-1] - capacity, out=self.moe_sft_excess)
            routed = routed.clamp(max=capacity)
            tokens_per_expert = torch.diff(routed, prepend=routed.new_zeros(1))
        rows = BoundedRows(capacity, width, routed[-1])
    else:
        rows = CountedRows(int(tokens_per_expert.sum()), width)
    permuted, self.local_probs, self.reversed_local_input_permutation_mapping = permute(
        hidden_states, self.local_map, probs=probs[:, local], num_out_tokens=rows
    )
    self.routing_map = None
    return permuted, tokens_per_expert, self.local_probs


_megatron_allgather_combine = patches.original(token_dispatcher.MoEAllGatherTokenDispatcher, "token_combine")


def _allgather_combine(self, hidden_states):
    """megatron's allgather `token_combine`; with `moe_sft_combine_dtype` bf16 the reduce-scatter
    sums the expert outputs in their own dtype (megatron casts them to fp32 first: twice the bytes)."""
    if getattr(self, "moe_sft_combine_dtype", "fp32") == "fp32" or (self.tp_size == 1 and self.ep_size == 1):
        return _megatron_allgather_combine(self, hidden_states)
    return reduce_scatter_to_sequence_parallel_region(hidden_states, group=self.tp_ep_group)


def set_combine_dtype(chunks, dtype: str) -> int:
    """Sets the combine's reduce-scatter dtype (`model.moe_combine_dtype`) of every allgather
    dispatcher of the chunks; returns how many layers."""
    dispatchers = _allgather_dispatchers(chunks)
    for _, dispatcher in dispatchers:
        dispatcher.moe_sft_combine_dtype = dtype
    return len(dispatchers)


def _allgather_dispatchers(chunks) -> list:
    """(layer, dispatcher) of every MoE layer of the chunks with the allgather dispatcher."""
    from megatron.core.utils import get_attr_wrapped_model

    return [
        (layer, dispatcher)
        for chunk in chunks
        for layer in get_attr_wrapped_model(chunk, "decoder").layers
        if isinstance(
            dispatcher := getattr(getattr(layer, "mlp", None), "token_dispatcher", None),
            token_dispatcher.MoEAllGatherTokenDispatcher,
        )
    ]


def use_gather_permutation() -> None:
    """Make megatron's token dispatchers use the functions above (they import them by name)."""
    alltoall, allgather = token_dispatcher.MoEAlltoAllTokenDispatcher, token_dispatcher.MoEAllGatherTokenDispatcher
    for owner, name, new in (
        (token_dispatcher, "permute", permute),
        (token_dispatcher, "unpermute", unpermute),
        (token_dispatcher, "sort_chunks_by_idxs", sort_chunks_by_idxs),
        (alltoall, "preprocess", _alltoall_preprocess),
        (allgather, "dispatch_postprocess", _allgather_postprocess),
        (allgather, "token_combine", _allgather_combine),
    ):
        patches.swap(owner, name, new, group=patches.KERNELS, reason="gather permutation, sync-free dispatch")


def static_rows_worst(ep: int, topk: int, local_experts: int) -> float:
    """The most rows a rank's experts can get over their expected routed rows: EP x min(top-k, local) / top-k."""
    return ep * min(topk, local_experts) / topk


def static_rows_bound(ep: int, topk: int, local_experts: int, capacity: float = STATIC_ROWS_CAPACITY) -> float:
    """A rank's static row count over its expected routed rows: the worst case, capped at `capacity`."""
    return min(static_rows_worst(ep, topk, local_experts), capacity)


def static_rows_count(tokens: int, dispatcher, capacity: float) -> int:
    """The static row count of a rank's local permutation of `tokens` gathered tokens."""
    local, experts = dispatcher.num_local_experts, dispatcher.config.num_moe_experts
    worst = tokens * min(dispatcher.router_topk, local)
    return min(worst, math.ceil(capacity * tokens * dispatcher.router_topk * local / experts))


def enable_static_rows(chunks, static: bool, capacity: float = STATIC_ROWS_CAPACITY) -> int:
    """Turns on static rows (`static`: the run's `Layout.static_rows`, moe_sft/config/layout.py) in
    every allgather dispatcher of the chunks whose experts read no row beyond their offsets (no
    biases, no adapters), capped at `capacity` x the expected rows; returns how many layers."""
    enabled = 0
    for layer, dispatcher in _allgather_dispatchers(chunks):
        experts = layer.mlp.experts
        plain = getattr(experts, "bias1", None) is None and getattr(experts, "adapter", None) is None
        on = static and plain and not dispatcher.config.moe_permute_fusion
        dispatcher.moe_sft_static_rows = on
        dispatcher.moe_sft_capacity = capacity
        # the most rows routing sent above the capacity since the last look (row_capacity.py); kept
        # across calls, since a captured graph holds its address
        if getattr(dispatcher, "moe_sft_excess", None) is None:
            device = next(layer.mlp.parameters()).device
            dispatcher.moe_sft_excess = torch.zeros((), dtype=torch.long, device=device)
        enabled += on
    return enabled


def capped_dispatchers(chunks) -> list:
    """(layer number, dispatcher) of every static-row dispatcher whose routing can exceed its capacity."""
    return [
        (layer.layer_number, d)
        for layer, d in _allgather_dispatchers(chunks)
        if getattr(d, "moe_sft_static_rows", False)
        and static_rows_worst(d.ep_size, d.router_topk, d.num_local_experts) > d.moe_sft_capacity
    ]
