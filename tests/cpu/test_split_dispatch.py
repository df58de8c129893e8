"""moe_sft.layers.split_dispatch: a MoE layer's dispatch in token chunks gives the unsplit layer's
output and gradients, and launches each chunk's collectives so that they overlap another chunk's
experts, forward and backward. (At EP2 over two ranks: tests/dist/test_expert_parallel.py.)"""

import pytest
import torch

from moe_sft.layers import split_dispatch
from moe_sft.layers.split_dispatch import chunk_bounds


@pytest.fixture
def one_rank_world():
    from moe_sft.kernels import install as kernels_install
    from moe_sft.runtime import device as rdevice
    from tests.cpu.test_plan import _reset_world

    rdevice.prepare_runtime(rdevice.RuntimeChoice("cpu", "fp32", "torch", ()))
    kernels_install.install()
    yield
    _reset_world()


def _allgather_layer():
    """The tiny Qwen3-MoE's first MoE layer with the allgather dispatcher, told it has a peer rank
    (an expert group of one rank gathers and reduce-scatters to itself, so the results stay exact)."""
    from tests.cpu.test_permute import _moe_layers

    moe = _moe_layers("allgather")[0].float()  # fp32: the per-chunk sums of weight gradients round less
    moe.token_dispatcher.ep_size = 2
    return moe


def _output_and_grads(moe, x):
    x = x.clone().requires_grad_(True)
    for p in moe.parameters():
        p.grad = None
    out, bias = moe(x)
    assert bias is None
    (out * torch.linspace(-1, 2, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("static_rows", [False, True])
def test_chunks_give_the_unsplit_layer_s_output_and_gradients(one_rank_world, static_rows):
    """2 and 3 chunks (3 uneven: 13 tokens), with counted and with static rows (each chunk then has
    its own capacity): the output and every gradient are the unsplit layer's to fp32 rounding (the
    CPU's GEMMs block a chunk's rows differently; the weights' gradients are summed per chunk)."""
    moe = _allgather_layer()
    d = moe.token_dispatcher
    d.moe_sft_static_rows, d.moe_sft_capacity = static_rows, 2.0
    d.moe_sft_excess = torch.zeros((), dtype=torch.long)
    x = torch.randn(13, 1, moe.config.hidden_size, generator=torch.Generator().manual_seed(3))
    ref_out, ref_x_grad, ref_grads = _output_and_grads(moe, x)
    for chunks in (2, 3):
        moe.moe_sft_dispatch_chunks = chunks
        moe.forward = split_dispatch.split_forward.__get__(moe)
        out, x_grad, grads = _output_and_grads(moe, x)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(x_grad, ref_x_grad, rtol=1e-5, atol=1e-7)
        assert grads.keys() == ref_grads.keys() and "router.weight" in grads
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert int(d.moe_sft_excess) == 0


def test_each_chunk_s_collectives_are_in_flight_while_another_chunk_computes(one_rank_world, monkeypatch):
    """The schedule that makes the overlap, forward and backward, read from the order in which the
    collectives are launched and waited for and the experts run."""
    moe = _allgather_layer()
    moe.moe_sft_dispatch_chunks = 2
    moe.forward = split_dispatch.split_forward.__get__(moe)
    events = []

    class _LoggedWork:
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self):
            events.append(f"wait {self.name}")
            return self.work.wait()

    def logged(kind):
        start = split_dispatch._COLLECTIVES[kind]

        def launch(x, group):
            name = f"{kind} {x.dtype} {tuple(x.shape)}"
            events.append(f"launch {name}")
            out, work = start(x, group)
            return out, _LoggedWork(work, name)

        return launch

    for kind in ("all_gather", "reduce_scatter"):
        monkeypatch.setitem(split_dispatch._COLLECTIVES, kind, logged(kind))
    moe.experts.register_forward_hook(lambda *_: events.append("experts"))
    hidden = moe.config.hidden_size
    x = torch.randn(16, 1, hidden, requires_grad=True)
    out, _ = moe(x)
    forward, events[:] = list(events), []
    out.sum().backward()
    backward = events

    half = f"(8, {hidden})"
    gather, scatter = f"all_gather torch.float32 {half}", f"reduce_scatter torch.float32 {half}"
    # forward: chunk 0's tokens leave before the router runs; chunk 1's travel during chunk 0's
    # experts, chunk 0's combine during chunk 1's experts; the combines are read last
    assert forward[0] == f"launch {gather}"
    assert forward[1].startswith("launch all_gather torch.bool") and forward[2].startswith("launch all_gather")
    assert forward[3:] == [
        f"launch {gather}",
        forward[1].replace("launch", "wait"),
        forward[2].replace("launch", "wait"),
        f"wait {gather}",
        "experts",
        f"launch {scatter}",
        f"wait {gather}",
        "experts",
        f"launch {scatter}",
        f"wait {scatter}",
        f"wait {scatter}",
    ]
    # backward: both output gradients are gathered at once; chunk 1's experts run their backward
    # (between waiting for its gradient and launching its token gradient's reduce-scatter) while
    # chunk 0's gather is in flight, chunk 0's while chunk 1's reduce-scatter is
    grad_gather, grad_scatter = f"all_gather torch.float32 {half}", f"reduce_scatter torch.float32 {half}"
    assert backward[:6] == [
        f"launch {grad_gather}",
        f"launch {grad_gather}",
        f"wait {grad_gather}",
        f"launch {grad_scatter}",
        f"wait {grad_gather}",
        f"launch {grad_scatter}",
    ]
    probs_scatter = [e for e in backward[6:] if e.startswith("launch")]
    assert len(probs_scatter) == 1 and "reduce_scatter" in probs_scatter[0]  # the probs' gradient
    assert sorted(e for e in backward if e.startswith("wait")) == sorted(
        e.replace("launch", "wait") for e in backward if e.startswith("launch")
    )


def test_chunk_bounds_cover_every_token_once_and_never_leave_a_chunk_empty():
    assert chunk_bounds(13, 3) == [(0, 4), (4, 8), (8, 13)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2)]
    assert chunk_bounds(8192, 2) == [(0, 4096), (4096, 8192)]


def test_layers_that_cannot_split_say_why(one_rank_world):
    """At EP x TP = 1 there is nothing to overlap; the alltoall dispatcher and megatron's MoE-layer
    recompute are refused by name (its checkpoint would launch every collective twice)."""
    from tests.cpu.test_permute import _moe_layers

    moe = _moe_layers("allgather")[0]
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.decoder.layers[0].mlp = moe
    assert split_dispatch.enable([model], 2, expert_group=1) == (0, ["EP x expert TP = 1: no collectives to overlap"])
    moe.token_dispatcher.ep_size = 2
    moe.moe_layer_recompute = True
    assert split_dispatch.splittable(moe).startswith("MoE-layer recomputation")
    moe.moe_layer_recompute = False
    assert split_dispatch.enable([model], 2, expert_group=2) == (1, [])
    assert moe.moe_sft_dispatch_chunks == 2 and moe.forward.__func__ is split_dispatch.split_forward
    a2a = _moe_layers("alltoall")[0]
    assert "MoEAlltoAllTokenDispatcher" in split_dispatch.splittable(a2a)
