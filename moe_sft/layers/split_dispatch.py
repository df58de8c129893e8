"""The allgather dispatcher's collectives overlapped with the experts: a MoE layer's tokens in chunks.

At EP (x expert TP) > 1 the allgather dispatcher gathers every rank's tokens before the experts and
reduce-scatters their outputs after them, and megatron waits for each collective where it is
launched: the GPU computes nothing while the tokens travel, and every rank waits there for the
slowest; that was most of what separated EP4 from one GPU per layer (docs/log.md).

With `model.moe_dispatch_chunks` = n > 1 each micro-batch's MoE layer cuts its tokens into n
chunks (the same cut on every rank) and dispatches each on its own: the router runs once over the
whole micro-batch, then chunk i's experts run while chunk i+1's gather and chunk i-1's
reduce-scatter are on the wire (NCCL runs them on its own stream). The first gather is launched
before the router, so it overlaps the router too.

How, with no stream of our own: every collective is a pair of autograd Functions, `_Launch` and
`_Wait`. Forward: the launch starts it (`async_op=True`) and the wait, placed where the result is
first read, waits for it. Backward runs them the other way round: the wait's backward launches
the reverse collective (a gather's is a reduce-scatter) and the launch's backward waits for it.
autograd runs the ready node created last first, so in backward chunk i+1's gradient collective
is in flight while chunk i's experts run their backward. Each launch is waited inside the same
forward or backward, so a CUDA graph of the layer (moe_sft/trainer/cuda_graphs.py) forks and joins
NCCL's stream within one capture.

What the chunks cost: the grouped GEMMs run over 1/n of the rows each (smaller, less efficient),
a layer's weight gradients are added n times, and eagerly (without static rows) the host waits
once per chunk for its row count. Each chunk gets its own static-row capacity (kernels/permute.py),
1/n of the layer's, so routing overflows it a little more often than the whole layer's.

Over NVLink on one host chunks ran slower than the unsplit step (docs/log.md): the overlapped NCCL
kernels take SMs from the grouped GEMMs (fewer NCCL channels cost the unsplit step more), and
each chunk's GEMMs are half as large. So it is off by default; it is kept for links where the
collectives take longer than the SMs they hold (untested: between nodes).

The numbers are those of one dispatch: a token's experts, probs and combine do not depend on
which other tokens share its chunk. Only the weight gradients' fp32 sums are ordered per chunk.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

# MoELayer methods whose work split_forward does in its own way instead of calling them
_HOOKS_SPLIT_FORWARD_INLINES = ("preprocess", "postprocess")


class _InFlight:
    """A collective between its launch and its wait: the NCCL work handle and its output."""

    __slots__ = ("work", "out")

    def __init__(self):
        self.work = self.out = None


def _all_gather(x: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    return out, dist.all_gather_into_tensor(out, x, group=group, async_op=True)


def _reduce_scatter(x: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    return out, dist.reduce_scatter_tensor(out, x, group=group, async_op=True)


# by name: a collective and the one its backward runs
_COLLECTIVES = {"all_gather": _all_gather, "reduce_scatter": _reduce_scatter}
_REVERSE = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather"}


class _Launch(torch.autograd.Function):
    """Forward: starts `collective(x)` and returns its output, not yet written (read it only after
    the `_Wait`). Backward: waits for the reverse collective the wait's backward started."""

    @staticmethod
    def forward(ctx, x, collective, group, flight):
        ctx.flight = flight
        flight.out, flight.work = _COLLECTIVES[collective](x, group)
        return flight.out

    @staticmethod
    def backward(ctx, _placeholder):
        flight = ctx.flight
        flight.work.wait()
        grad, flight.work, flight.out = flight.out, None, None
        return grad, None, None, None


class _Wait(torch.autograd.Function):
    """Forward: waits for the launched collective, returns its output. Backward: starts the reverse
    collective over the gradient; the launch's backward returns its result."""

    @staticmethod
    def forward(ctx, out, collective, group, flight):
        flight.work.wait()
        flight.work = flight.out = None
        ctx.collective, ctx.group, ctx.flight = collective, group, flight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        flight.out, flight.work = _COLLECTIVES[_REVERSE[ctx.collective]](grad, ctx.group)
        # a stand-in of the right shape for the launch's backward, which ignores it
        return grad, None, None, None


class _Collective:
    """One collective over the expert group, launched now and read later."""

    def __init__(self, x: torch.Tensor, collective, group):
        self.flight, self.collective, self.group = _InFlight(), collective, group
        self.pending = _Launch.apply(x, collective, group, self.flight)

    def result(self) -> torch.Tensor:
        return _Wait.apply(self.pending, self.collective, self.group, self.flight)


class _ChunkState:
    """A chunk's view of the layer's dispatcher: reads fall through to the dispatcher (its groups,
    config, static-row settings), the per-dispatch state the dispatcher keeps between its calls
    (routing map, permutation, local probs) is written here, so chunks in flight do not share it."""

    def __init__(self, dispatcher):
        self.__dict__["_dispatcher"] = dispatcher

    def __getattr__(self, name):
        return getattr(self.__dict__["_dispatcher"], name)


def _rows_of_chunk(gathered: torch.Tensor, ranks: int, lo: int, hi: int) -> torch.Tensor:
    """The rows of a [ranks x tokens, ...] gather (rank-major) that belong to tokens [lo, hi) of
    every rank, in the order a gather of those tokens gives them."""
    per_rank = gathered.view(ranks, -1, *gathered.shape[1:])
    return per_rank[:, lo:hi].reshape(ranks * (hi - lo), *gathered.shape[1:])


def chunk_bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) of each chunk: as equal as the token count allows, none empty."""
    chunks = max(1, min(chunks, tokens))
    edges = [tokens * i // chunks for i in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


def split_forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
    """megatron's `MoELayer.forward` (same arguments, same results) with the dispatch in chunks
    whose collectives overlap the other chunks' experts. Bound to a layer by `enable`."""
    dispatcher = self.token_dispatcher
    if intermediate_tensors is not None:  # (`enable` binds it only where the expert group has peers)
        return type(self).forward(self, hidden_states, intermediate_tensors, padding_mask)
    if padding_mask is not None:
        padding_mask = padding_mask.transpose(0, 1).bool()
    group = dispatcher.tp_ep_group
    ranks = dist.get_world_size(group)
    tokens = hidden_states.view(-1, hidden_states.shape[-1])
    bounds = chunk_bounds(tokens.shape[0], self.moe_sft_dispatch_chunks)
    # Launched first: the first chunk's tokens travel while the shared experts and the router run.
    gathers = [_Collective(tokens[slice(*bounds[0])], "all_gather", group)]
    shared_output = self.shared_experts_compute(hidden_states)
    probs, routing_map = self.route(hidden_states, padding_mask)
    _, probs = self.preprocess(hidden_states, probs, routing_map)
    with torch.no_grad():
        routing_map = _Collective(dispatcher.routing_map, "all_gather", group)
    probs = _Collective(probs, "all_gather", group)
    gathers += [_Collective(tokens[lo:hi], "all_gather", group) for lo, hi in bounds[1:]]
    routing_map, probs = routing_map.result(), probs.result()
    dispatcher.routing_map = None

    combines = []
    for (lo, hi), gather in zip(bounds, gathers):
        state = _ChunkState(dispatcher)
        state.routing_map = _rows_of_chunk(routing_map, ranks, lo, hi)
        rows, tokens_per_expert, rows_probs = MoEAllGatherTokenDispatcher.dispatch_postprocess(
            state, gather.result(), _rows_of_chunk(probs, ranks, lo, hi)
        )
        expert_output, mlp_bias = self.experts(rows, tokens_per_expert, rows_probs)
        assert mlp_bias is None, f"mlp_bias is not supported for {type(dispatcher)}"
        output = MoEAllGatherTokenDispatcher.combine_preprocess(state, expert_output)
        dtype = output.dtype
        if getattr(dispatcher, "moe_sft_combine_dtype", "fp32") == "fp32":
            output = output.to(state.local_probs.dtype)  # as megatron's token_combine
        combines.append((_Collective(output, "reduce_scatter", group), dtype))
    output = torch.cat([combine.result().to(dtype) for combine, dtype in combines])
    output = output.view(hidden_states.shape)
    if shared_output is not None:
        output = output + shared_output
    return output, None


def splittable(layer) -> str | None:
    """Why this MoE layer cannot run its dispatch in chunks (None: it can)."""
    dispatcher = layer.token_dispatcher
    config = layer.config
    if not isinstance(dispatcher, MoEAllGatherTokenDispatcher):
        return f"the {type(dispatcher).__name__} (chunks need the allgather dispatcher)"
    if config.moe_permute_fusion:
        return "moe_permute_fusion (Transformer Engine's permutation)"
    if layer.moe_layer_recompute:
        return "MoE-layer recomputation (its checkpoint would launch each collective twice)"
    if config.moe_latent_size or getattr(layer, "shared_expert_overlap", False):
        return "latent MoE projections or megatron's shared-expert overlap"
    if any(getattr(type(layer), hook) is not getattr(MoELayer, hook) for hook in _HOOKS_SPLIT_FORWARD_INLINES):
        # split_forward dispatches the raw tokens and adds the shared output itself
        return f"a MoE layer with its own preprocess or postprocess ({type(layer).__name__})"
    return None


def _moe_layers(chunks) -> list:
    from megatron.core.utils import get_attr_wrapped_model

    layers = (layer for chunk in chunks for layer in get_attr_wrapped_model(chunk, "decoder").layers)
    return [layer.mlp for layer in layers if hasattr(getattr(layer, "mlp", None), "token_dispatcher")]


def enable(chunks, pieces: int, expert_group: int) -> tuple[int, list[str]]:
    """Runs every splittable MoE layer of the model chunks with its dispatch in `pieces` token
    chunks (`model.moe_dispatch_chunks`); `expert_group`: the run's Layout.expert_group (EP x
    expert-TP). Returns (layers split, why others were not)."""
    split, reasons = 0, set()
    for moe in _moe_layers(chunks):
        if expert_group == 1:
            reasons.add("EP x expert TP = 1: no collectives to overlap")
            continue
        reason = splittable(moe)
        if reason is not None:
            reasons.add(reason)
            continue
        moe.moe_sft_dispatch_chunks = pieces
        moe.forward = types.MethodType(split_forward, moe)
        split += 1
    return split, sorted(reasons)
