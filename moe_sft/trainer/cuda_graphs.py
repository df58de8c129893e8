"""CUDA graphs of the MoE half of every MoE layer (`trainer.cuda_graphs`).

Why: at a 4096-token micro-batch the step is bound by the host, not the GPU: the forward +
backward takes longer than its kernels (docs/benchmarks.md), because the Python of megatron's MoE
layer (router, aux loss, dispatcher, experts, combine, ~20 autograd Functions) runs once per layer
and micro-batch. A graph replays all of those kernels, forward and backward, for the cost of one
launch (the gain on one GPU: docs/log.md).

What is captured, per MoE layer: megatron's `TransformerLayer._forward_mlp`, i.e. the pre-MLP norm,
the router (top-k, aux loss, our routing statistics), the permutation, the grouped expert GEMMs,
the combine and the residual add; the padding mask is a static input too (all False for a
micro-batch without padding). Attention stays eager: its kernels depend on the documents of a
micro-batch (cu_seqlens, max length), the MoE half only on the token count. With EP x TP = 1 the
dropless dispatch has no host sync and fixed sizes (moe_sft/kernels/permute.py), so one graph
serves every micro-batch of that length; micro-batches are padded to `data.pack_length`. With
EP > 1 the allgather dispatcher's gather and reduce-scatter have fixed sizes too, and with static
rows so has its local permutation: the graph holds those NCCL collectives (`dispatch_ineligible`
says where that does not hold: the alltoall, or experts with biases or adapters). Past EP2 the
static rows are capped below their worst case; a step whose routing exceeds the cap inside a
graph runs again eagerly (moe_sft/trainer/row_capacity.py).

What the graphs rely on, and how it is kept true:
- Every micro-batch's forward is followed by its backward before the next forward (PP = 1): each
  graph's inputs, outputs and saved activations are static buffers, reused per micro-batch.
- Python side effects do not replay. The fused weight-gradient paths (our expert wgrad, megatron's
  gradient_accumulation_fusion) set `grad_added_to_main_grad` in their backward; the replay sets it
  for the weights that set it during capture (as megatron's own graph runner does), so DDP's hook
  does not add their placeholder gradient again. Those weights are not graph inputs, so their
  placeholders cost no static memory; their gradients go into main_grad inside the graph.
- In-place state is captured by address: main grads, the aux-loss tracker and scale
  (`set_loss_scale` copies in place), the routing statistics, the expert-bias token counts.
  Capture runs warm-up iterations that add into all of them; `reset_after_capture` clears them.
- The expert wgrad's side stream (moe_sft/kernels/wgrad.py) would fork inside the capture and join
  outside it: graphs keep it on the compute stream.
Not graphable, refused with the reason (`ineligible`): CPU, TP/CP/PP > 1, recompute,
activation offload, overlapped gradient reduction or parameter all-gather (DDP's hooks would not
run for the graphed weights), offload between steps. Data parallel is fine: each rank replays its
own graphs and DDP reduces the main grads after the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_sft.config.validate import cuda_graphs_ineligible as ineligible  # noqa: F401  (the rules are config checks)

# False (trainer.cuda_graphs_replay=false, set by capture_moe_graphs): capture, then run every layer
# eagerly anyway: the same padding, data and stream use, for parity checks and A/B timings
# (tests/gpu/test_gpu_cuda_graphs.py, benchmarks/gpu/ab_steps.py)
REPLAY = True


def moe_layers(chunks) -> list:
    """The decoder's MoE TransformerLayers of the (DDP-wrapped) chunks, in forward order."""
    from megatron.core.utils import get_attr_wrapped_model

    return [
        layer
        for chunk in chunks
        for layer in get_attr_wrapped_model(chunk, "decoder").layers
        if getattr(layer, "is_moe_layer", False)
    ]


@dataclass
class _LayerGraph:
    """One layer's captured forward and backward, and the static buffers they read and write."""

    eager: Callable  # the layer's own _forward_mlp
    params: list  # weights whose gradient the graph returns (graph inputs)
    fused: list  # weights whose gradient the graph adds into main_grad
    static_in: torch.Tensor
    static_mask: torch.Tensor  # [1, tokens] padding mask (all False for a batch without padding)
    static_out: torch.Tensor | None = None
    static_grad_out: torch.Tensor | None = None
    static_grads: tuple = ()
    fwd: torch.cuda.CUDAGraph | None = None
    bwd: torch.cuda.CUDAGraph | None = None
    replays: int = 0
    eager_calls: int = 0  # training forwards that did not match (another length)

    def matches(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> bool:
        s = self.static_in
        return (
            x.shape == s.shape
            and x.dtype == s.dtype
            and x.device == s.device
            and x.requires_grad
            and (padding_mask is None or padding_mask.shape == self.static_mask.shape)
        )

    def run(self, x: torch.Tensor):
        return self.eager(x, None, padding_mask=self.static_mask)

    def run_eager(self) -> None:
        """A warm-up iteration (Triton compiles, cuBLAS plans, allocator pools), as in the capture."""
        out = self.run(self.static_in)
        torch.autograd.grad(out, [self.static_in, *self.params], torch.ones_like(out), allow_unused=True)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph: _LayerGraph, x: torch.Tensor, padding_mask: torch.Tensor | None, *params):
        graph.static_in.copy_(x)
        if padding_mask is None:
            graph.static_mask.zero_()
        else:
            graph.static_mask.copy_(padding_mask)
        graph.fwd.replay()
        ctx.graph = graph
        return graph.static_out.detach()

    @staticmethod
    def backward(ctx, grad_out):
        graph = ctx.graph
        graph.static_grad_out.copy_(grad_out)
        graph.bwd.replay()
        return (None, graph.static_grads[0], None, *graph.static_grads[1:])


def _trainable(modules) -> list:
    seen, out = set(), []
    for module in modules:
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def dispatch_ineligible(chunks, expert_group: int) -> list[str]:
    """Why the MoE layers' dispatch cannot be captured (empty: it can). `expert_group`: the run's
    Layout.expert_group (EP x expert-TP); alone (1) the dispatch is local. Past 1 the graph holds the
    allgather dispatcher's collectives, which have static sizes; its local permutation does too only
    with static rows (moe_sft/kernels/permute.py `enable_static_rows`), else it waits for the host."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    reasons = set()
    for layer in moe_layers(chunks) if expert_group > 1 else ():
        dispatcher = layer.mlp.token_dispatcher
        if not isinstance(dispatcher, MoEAllGatherTokenDispatcher):
            reasons.add(
                f"the {type(dispatcher).__name__} needs its split sizes on the host in every MoE layer; "
                "set model.moe_token_dispatcher_type=allgather"
            )
        elif not getattr(dispatcher, "moe_sft_static_rows", False):
            reasons.add(
                "experts with biases or adapters read every row of a static permutation: "
                "the allgather's local permutation then waits for the host"
            )
    return sorted(reasons)


def capture_moe_graphs(
    chunks, tokens: int, expert_group: int, warmup: int = 2, replay: bool = True
) -> list[_LayerGraph]:
    """Capture every MoE layer's `_forward_mlp` for `tokens`-token micro-batches and route the layer's
    training forward through the replay (`replay`=False: captured, but run eagerly); replaces the
    graphs of an earlier call (one length at a time). `expert_group`: Layout.expert_group (past 1
    the graphs hold collectives). Call `reset_after_capture` afterwards: the warm-up iterations had
    side effects."""
    global REPLAY
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from moe_sft.kernels import wgrad

    REPLAY = replay
    layers = moe_layers(chunks)
    if not layers:
        return []
    wgrad.OVERLAP = False  # the side stream would fork inside a capture and join outside it
    if MoEAuxLossAutoScaler.main_loss_backward_scale is None:
        # The backward reads the aux-loss scale by address; the schedule later copies into this [1]
        # tensor. (Left unset, the warm-up's backward would create a 0-d one the copy cannot fill.)
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device="cuda"))
    config = layers[0].config
    graphs = []
    for layer in layers:
        if not hasattr(layer, "_moe_sft_eager_mlp"):
            layer._moe_sft_eager_mlp = layer._forward_mlp
            layer._forward_mlp = _dispatch(layer)
        layer._moe_sft_graph = None  # an earlier length's graph: its memory goes back
        weights = _trainable([layer.pre_mlp_layernorm, layer.mlp])
        for p in weights:
            p.grad_added_to_main_grad = False
        x = torch.randn(tokens, 1, config.hidden_size, dtype=config.params_dtype, device="cuda", requires_grad=True)
        mask = torch.zeros(1, tokens, dtype=torch.bool, device="cuda")  # megatron's [b, s] padding mask
        graphs.append(
            _LayerGraph(eager=layer._moe_sft_eager_mlp, params=weights, fused=[], static_in=x, static_mask=mask)
        )

    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for graph in graphs:
            for _ in range(warmup):
                graph.run_eager()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for graph in graphs:  # a weight whose backward added into main_grad itself is not a graph input
        graph.fused = [p for p in graph.params if getattr(p, "grad_added_to_main_grad", False)]
        graph.params = [p for p in graph.params if not getattr(p, "grad_added_to_main_grad", False)]

    # One memory pool, captured in the order of replay (forwards in layer order, backwards in
    # reverse), as torch.cuda.make_graphed_callables does: a later capture reuses only memory an
    # earlier graph no longer needs.
    pool = torch.cuda.graph_pool_handle()
    # With EP > 1 the graphs hold NCCL collectives, and NCCL's watchdog thread runs beside the
    # capture; the default "global" mode would make its unsafe calls an error. As megatron's
    # full-iteration graphs, capture "thread_local": only this thread's unsafe calls are refused.
    mode = "thread_local" if expert_group > 1 else "global"
    leaves = []
    for layer, graph in zip(layers, graphs):
        # Autograd runs a leaf's gradient on the stream its accumulator was made on: the input's on
        # the warm-up stream, DDP's parameters' on the legacy default stream, and waiting on either
        # from inside a capture invalidates it. So the capture differentiates fresh leaves, made
        # while capturing: a new input, and aliases (same storage) of the weights the graph returns
        # gradients for, swapped into their modules for the capture only.
        graph.static_in = graph.static_in.detach().requires_grad_()
        graph.fwd, graph.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph.fwd, pool=pool, capture_error_mode=mode), _aliased(layer, graph.params) as aliases:
            graph.static_out = graph.run(graph.static_in)
        leaves.append(aliases)
    for graph, aliases in reversed(list(zip(graphs, leaves))):
        graph.static_grad_out = torch.empty_like(graph.static_out)
        with torch.cuda.graph(graph.bwd, pool=pool, capture_error_mode=mode):
            grads = torch.autograd.grad(
                graph.static_out, [graph.static_in, *aliases], graph.static_grad_out, allow_unused=True
            )
        graph.static_grads = tuple(g.detach() if g is not None else None for g in grads)
        graph.static_out = graph.static_out.detach()  # frees the captured autograd graph
    for layer, graph in zip(layers, graphs):
        layer._moe_sft_graph = graph
    return graphs


@contextlib.contextmanager
def _aliased(layer, params):
    """Swap each of `params` in its module for a new leaf Parameter on the same storage; restore."""
    owners = {
        id(p): (module, name)
        for top in (layer.pre_mlp_layernorm, layer.mlp)
        for module in top.modules()
        for name, p in module._parameters.items()
        if p is not None
    }
    slots = [owners[id(p)] for p in params]
    aliases = [torch.nn.Parameter(p.detach(), requires_grad=True) for p in params]
    try:
        for (module, name), alias in zip(slots, aliases):
            module._parameters[name] = alias
        yield aliases
    finally:
        for (module, name), p in zip(slots, params):
            module._parameters[name] = p


def _dispatch(layer):
    def forward_mlp(hidden_states, inference_context=None, padding_mask=None):
        graph = layer._moe_sft_graph
        if graph is not None and layer.training and torch.is_grad_enabled():
            if REPLAY and inference_context is None and graph.matches(hidden_states, padding_mask):
                for p in graph.fused:
                    p.grad_added_to_main_grad = True
                graph.replays += 1
                return _Replay.apply(graph, hidden_states, padding_mask, *graph.params)
            graph.eager_calls += 1
        return layer._moe_sft_eager_mlp(hidden_states, inference_context, padding_mask=padding_mask)

    return forward_mlp


def release(chunks) -> None:
    """Free every MoE layer's graphs. Called before the process groups are destroyed: with a graph
    that holds an NCCL collective (EP > 1) still alive, `destroy_process_group` never returned."""
    layers = [layer for layer in moe_layers(chunks) if getattr(layer, "_moe_sft_graph", None) is not None]
    if layers:
        torch.cuda.synchronize()
    for layer in layers:
        layer._moe_sft_graph.fwd.reset()
        layer._moe_sft_graph.bwd.reset()
        layer._moe_sft_graph = None


def reset_after_capture(chunks, routing_stats=None) -> None:
    """Undo what the warm-up iterations accumulated: main grads, aux-loss logs, routing statistics and
    the expert-bias token counts, the static rows' excess (all updated in place, which is why the
    graphs can keep them)."""
    from megatron.core.transformer.moe import moe_utils

    for chunk in chunks:
        chunk.zero_grad_buffer()
    moe_utils.clear_aux_losses_tracker()
    if routing_stats is not None:
        routing_stats.acc.zero_()
    for layer in moe_layers(chunks):
        counts = getattr(layer.mlp.router, "local_tokens_per_expert", None)
        if counts is not None:
            counts.zero_()
        excess = getattr(layer.mlp.token_dispatcher, "moe_sft_excess", None)  # kernels/permute.py
        if excess is not None:
            excess.zero_()


def captured_length(chunks) -> int | None:
    """The micro-batch length the MoE layers' graphs were captured for (None: none are)."""
    lengths = {
        getattr(layer, "_moe_sft_graph", None) and layer._moe_sft_graph.static_in.shape[0]
        for layer in moe_layers(chunks)
    }
    return lengths.pop() if len(lengths) == 1 else None


def replay_counts(chunks) -> tuple[int, int]:
    """(graph replays, eager training forwards) summed over the MoE layers."""
    graphs = [g for g in (getattr(layer, "_moe_sft_graph", None) for layer in moe_layers(chunks)) if g is not None]
    return sum(g.replays for g in graphs), sum(g.eager_calls for g in graphs)
