"""moe_sft/trainer/cuda_graphs.py on CPU: what routes a layer's MoE half to its graph and what does
not, and the weight aliasing of the capture (the capture itself needs CUDA:
tests/gpu/test_gpu_cuda_graphs.py)."""

from __future__ import annotations

import types

import torch

from moe_sft.trainer import cuda_graphs


class _Layer(torch.nn.Module):
    is_moe_layer = True

    def __init__(self):
        super().__init__()
        self.pre_mlp_layernorm = torch.nn.LayerNorm(4)
        self.mlp = torch.nn.Linear(4, 4)
        self.mlp.router = types.SimpleNamespace()
        self.calls = []

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None):
        self.calls.append(padding_mask)
        return self.mlp(self.pre_mlp_layernorm(hidden_states))


def _model(layers):
    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList(layers)
    model = torch.nn.Module()
    model.decoder = decoder
    wrapped = torch.nn.Module()  # as DDP(Float16Module(model))
    wrapped.module = torch.nn.Module()
    wrapped.module.module = model
    return wrapped


def test_moe_layers_unwraps_and_skips_dense_layers():
    dense = _Layer()
    dense.is_moe_layer = False
    moe = _Layer()
    assert cuda_graphs.moe_layers([_model([dense, moe])]) == [moe]
    assert cuda_graphs.captured_length([_model([moe])]) is None


def test_dispatch_replays_only_matching_training_calls(monkeypatch):
    layer = _Layer()
    layer._moe_sft_eager_mlp = layer._forward_mlp
    layer._forward_mlp = cuda_graphs._dispatch(layer)
    layer._moe_sft_graph = None
    x = torch.randn(6, 1, 4, requires_grad=True)
    layer._forward_mlp(x)  # no graph: eager, not counted
    graph = cuda_graphs._LayerGraph(
        eager=layer._moe_sft_eager_mlp,
        params=[],
        fused=[layer.mlp.weight],
        static_in=torch.zeros(6, 1, 4),
        static_mask=torch.zeros(1, 6, dtype=torch.bool),
    )
    layer._moe_sft_graph = graph
    replayed = []
    monkeypatch.setattr(cuda_graphs._Replay, "apply", lambda g, h, mask, *p: replayed.append(mask) or h)
    layer._forward_mlp(x)
    assert replayed == [None] and graph.replays == 1 and layer.mlp.weight.grad_added_to_main_grad
    layer._forward_mlp(torch.randn(5, 1, 4, requires_grad=True))  # another length
    layer._forward_mlp(x, padding_mask=torch.zeros(1, 5, dtype=torch.bool))  # a mask of another shape
    with torch.no_grad():
        layer._forward_mlp(x)  # evaluation: eager, not counted
    layer.eval()
    layer._forward_mlp(x)  # eval mode: eager, not counted
    assert (graph.replays, graph.eager_calls) == (1, 2)
    monkeypatch.setattr(cuda_graphs, "REPLAY", False)
    layer.train()
    layer._forward_mlp(x)
    assert (graph.replays, graph.eager_calls) == (1, 3)
    assert cuda_graphs.replay_counts([_model([layer])]) == (1, 3)
    assert cuda_graphs.captured_length([_model([layer])]) == 6


def test_aliased_swaps_weights_for_leaves_on_the_same_storage_and_restores_them():
    layer = _Layer()
    weight, bias = layer.mlp.weight, layer.mlp.bias
    with cuda_graphs._aliased(layer, [weight]) as (alias,):
        assert layer.mlp.weight is alias and alias is not weight and alias.is_leaf
        assert alias.data_ptr() == weight.data_ptr() and layer.mlp.bias is bias
    assert layer.mlp.weight is weight


def _dispatcher(cls, ep: int, topk: int = 8, local: int = 64, static: bool = False):
    d = object.__new__(cls)  # the attributes the rule reads, without process groups
    d.ep_size, d.tp_size, d.router_topk, d.num_local_experts, d.moe_sft_static_rows = ep, 1, topk, local, static
    return d


def test_expert_parallel_dispatch_is_captured_only_with_static_rows():
    """EP > 1: the allgather with static rows has static sizes and no host wait (capturable), at EP4
    too (its rows capped at 2x); the alltoall and a counted permutation (experts with biases or
    adapters) wait for the host, and the reason names what to change."""
    from megatron.core.transformer.moe import token_dispatcher as td

    def reasons(dispatcher):
        layer = _Layer()
        layer.mlp.token_dispatcher = dispatcher
        return cuda_graphs.dispatch_ineligible([_model([layer])], expert_group=dispatcher.ep_size)

    assert reasons(_dispatcher(td.MoEAlltoAllTokenDispatcher, ep=1)) == []  # local dispatch
    assert reasons(_dispatcher(td.MoEAllGatherTokenDispatcher, ep=2, static=True)) == []
    assert reasons(_dispatcher(td.MoEAllGatherTokenDispatcher, ep=4, static=True)) == []
    (alltoall,) = reasons(_dispatcher(td.MoEAlltoAllTokenDispatcher, ep=2))
    assert "MoEAlltoAllTokenDispatcher needs its split sizes on the host" in alltoall
    assert "model.moe_token_dispatcher_type=allgather" in alltoall
    (biased,) = reasons(_dispatcher(td.MoEAllGatherTokenDispatcher, ep=4))  # left counted
    assert "experts with biases or adapters read every row" in biased


def test_release_resets_every_graph_and_needs_no_cuda_without_graphs(monkeypatch):
    """Trainer.close frees the graphs before the process groups go (an NCCL collective inside a live
    graph kept destroy_process_group from returning); a run without graphs (CPU) touches no CUDA."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    plain = _Layer()
    plain._moe_sft_graph = None
    cuda_graphs.release([_model([plain])])
    assert syncs == []

    resets = []
    graphed = _Layer()
    graphed._moe_sft_graph = types.SimpleNamespace(
        fwd=types.SimpleNamespace(reset=lambda: resets.append("fwd")),
        bwd=types.SimpleNamespace(reset=lambda: resets.append("bwd")),
    )
    cuda_graphs.release([_model([plain, graphed])])
    assert syncs == [1] and resets == ["fwd", "bwd"] and graphed._moe_sft_graph is None
