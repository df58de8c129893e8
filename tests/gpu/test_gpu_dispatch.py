"""One GPU: a MoE layer's forward and backward with the alltoall dispatcher at EP x TP = 1 make no
host sync (torch.cuda.set_sync_debug_mode("error") turns any into an exception), and give the same
output and gradients as megatron's own permute/unpermute with their host syncs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _moe_layer(dispatcher="auto"):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_sft.kernels import install as kernels_install
    from moe_sft.models import qwen3_moe
    from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config
    from moe_sft.runtime import device as rdevice
    from moe_sft.runtime import distributed

    rdevice.prepare_runtime(rdevice.RuntimeChoice("cuda", "bf16", "torch", ()))
    kernels_install.install()
    distributed.init_process_group("cuda")
    distributed.init_model_parallel()
    hf = qwen3_moe.tiny_hf_config(
        num_hidden_layers=1, hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4
    )
    opts = ModelOptions(
        precision="bf16", backend="torch", device="cuda", transformer={"moe_token_dispatcher_type": dispatcher}
    )
    torch.manual_seed(0)
    model = build_model_chunks(qwen3_moe.FAMILY, hf, build_transformer_config(qwen3_moe.FAMILY, hf, opts), opts)[0]
    moe = next(m for m in model.modules() if isinstance(m, MoELayer))
    assert moe.config.moe_token_dispatcher_type == ("alltoall" if dispatcher == "auto" else dispatcher)
    return moe


def _run(moe, x):
    x = x.clone().requires_grad_(True)
    for p in moe.parameters():
        p.main_grad.zero_() if getattr(p, "main_grad", None) is not None else setattr(p, "grad", None)
    out, _ = moe(x)
    out.float().square().sum().backward()
    grads = [(p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone() for p in moe.parameters()]
    return out.detach(), x.grad, grads


def test_ep1_dispatch_makes_no_host_sync_and_matches_megatron():
    from megatron.core.transformer.moe import token_dispatcher

    from moe_sft.kernels import permute as ours

    moe = _moe_layer()
    x = torch.randn(2048, 1, moe.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    _run(moe, x)  # warm-up: lazy CUDA initialisation, allocator growth
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, x_grad, grads = _run(moe, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # megatron's unfused permute/unpermute and its device-to-host copy of the counts
    patched = (
        token_dispatcher.permute,
        token_dispatcher.unpermute,
        token_dispatcher.MoEAlltoAllTokenDispatcher.preprocess,
    )
    token_dispatcher.permute, token_dispatcher.unpermute = ours._megatron_permute, ours._megatron_unpermute
    token_dispatcher.MoEAlltoAllTokenDispatcher.preprocess = ours._megatron_alltoall_preprocess
    dispatcher = moe.token_dispatcher
    dispatcher.cuda_dtoh_point, dispatcher.cuda_sync_point = dispatcher._moe_sft_sync_points
    try:
        ref_out, ref_x_grad, ref_grads = _run(moe, x)
    finally:
        (
            token_dispatcher.permute,
            token_dispatcher.unpermute,
            token_dispatcher.MoEAlltoAllTokenDispatcher.preprocess,
        ) = patched
    torch.testing.assert_close(out, ref_out, rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(x_grad, ref_x_grad, rtol=1.6e-2, atol=1e-3)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1.6e-2, atol=1e-3)


def test_allgather_dispatch_waits_once_per_forward_and_equals_the_alltoall_one():
    """The allgather dispatcher (the GPU's auto choice at 1 < EP x expert-TP <= top-k) reads one
    number per MoE layer forward on the host (its local row count; megatron's waited five times)
    and nothing in the backward. Forced here on one GPU, its output equals the alltoall
    dispatcher's bit for bit; the gradients to bf16 rounding (the router probs' gradient is
    gathered in another order: the alltoall's comes from moe_sft/kernels/topk_rows.py)."""
    from benchmarks.measure import host_sync_sites

    a2a = _moe_layer("alltoall")
    x = torch.randn(2048, 1, a2a.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    ref = _run(a2a, x)
    gathered = _moe_layer("allgather")
    gathered.load_state_dict(a2a.state_dict())
    _run(gathered, x)  # warm-up
    results = []
    sites = host_sync_sites(lambda: results.append(_run(gathered, x)), "cuda")
    assert sum(sites.values()) == 1 and next(iter(sites)).startswith("moe_sft/kernels/permute.py:"), sites
    out, x_grad, grads = results[0]
    assert torch.equal(out, ref[0])
    torch.testing.assert_close(x_grad, ref[1], rtol=1.6e-2, atol=1e-3)
    for g, r in zip(grads, ref[2]):
        torch.testing.assert_close(g, r, rtol=1.6e-2, atol=1e-3)


def test_host_sync_census_names_the_line_that_waited():
    from benchmarks.measure import host_sync_sites

    x = torch.ones(4, device="cuda")

    def step():
        x.add_(1)
        x.sum().item()  # the one sync

    sites = host_sync_sites(step, "cuda")
    assert list(sites.values()) == [1] and next(iter(sites)).startswith("tests/gpu/test_gpu_dispatch.py:"), sites


def test_triton_gather_sum_equals_the_torch_sum_of_the_gathered_rows():
    """The combine's Triton kernel (moe_sft/kernels/gather_sum.py) against the same sum as torch ops,
    at the benchmark's shape: 4096 tokens x top-8 rows of 2048, some slots empty."""
    from moe_sft.kernels import gather_sum

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(4096 * 8, 2048, device="cuda", generator=g).to(torch.bfloat16)
    index = torch.randperm(4096 * 8, device="cuda", generator=g).view(4096, 8)
    index[::7, 3] = -1
    for src in (rows, rows.float(), torch.randn(300, 3000, device="cuda", generator=g)[:, :2900]):
        idx = index % src.shape[0] if src.shape[0] < rows.shape[0] else index
        idx = torch.where(index < 0, index, idx)
        ours, torch_ops = gather_sum.gather_sum(src, idx), gather_sum._gather_sum_torch(src, idx)
        assert ours.dtype == src.dtype
        exact = gather_sum._gather_sum_torch(src.double(), idx)
        # both accumulate 8 values in fp32 and round once: within one rounding of the exact sum
        tol = dict(rtol=2**-8, atol=1e-5) if src.dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(ours.double(), exact, **tol)
        torch.testing.assert_close(torch_ops.double(), exact, **tol)
    # an EP rank whose experts got no token: no rows, every slot empty -> zeros
    empty = gather_sum.gather_sum(rows[:0], torch.full((5, 8), -1, device="cuda"))
    assert empty.shape == (5, 2048) and empty.count_nonzero() == 0


@pytest.mark.parametrize("tokens,experts,k", [(4096, 128, 8), (4096, 256, 8), (1000, 60, 4), (7, 8, 2)])
def test_triton_topk_rows_equal_the_torch_permutation(tokens, experts, k):
    """moe_sft/kernels/topk_rows.py against permute.py's torch ops (the CPU path): the same rows,
    slots and row probabilities; a token with another count than k raises the flag that
    `topk_rows` asserts on (a failed device assert would end the process's CUDA context)."""
    from moe_sft.kernels import permute, topk_rows

    g = torch.Generator(device="cuda").manual_seed(4)
    choice = torch.randn(tokens, experts, device="cuda", generator=g).topk(k, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda").scatter(1, choice, True)
    probs = torch.rand(tokens, experts, device="cuda", generator=g)
    assert topk_rows.fits(routing_map)
    rows, places, flat = permute._rows_and_slots_known(routing_map, tokens * k, k, exact=True)
    width = k
    expected = (rows, permute._slot_rows(places, tokens, width), probs.T.reshape(-1).index_select(0, flat))
    expected = tuple(t.detach() for t in expected)
    probs.requires_grad_(True)
    ours = topk_rows.topk_rows(routing_map, probs, k)
    for a, b in zip(ours, expected):
        assert torch.equal(a, b)
    ours[2].sum().backward()  # the router's probabilities get their gradient through the gather
    assert torch.equal(probs.grad, routing_map.float())
    assert topk_rows.unchecked_topk_rows(routing_map, k)[-1].item() == 0
    routing_map[tokens // 2, choice[tokens // 2, 0]] = False
    assert topk_rows.unchecked_topk_rows(routing_map, k)[-1].item() == 1


def test_static_rows_make_no_host_sync_and_their_padding_reaches_nothing():
    """The allgather's static rows (kernels/permute.py `BoundedRows`) on a local slice of 3 of the
    16 experts, as at EP > 1, with torch's grouped_mm as the experts: the rows past the last
    offset, which the GEMM leaves unwritten, must reach neither the output nor any gradient. Same
    result as the counted permutation (one host wait; tested against megatron's above and on the
    CPU), bit for bit forward; no host sync."""
    import torch.nn.functional as F
    from megatron.core.transformer.moe import token_dispatcher

    from moe_sft.kernels import permute as ours

    d = _moe_layer("allgather").token_dispatcher
    d.local_expert_indices, d.num_local_experts = [2, 3, 4], 3
    d.moe_sft_capacity, d.moe_sft_excess = 2.0, torch.zeros((), dtype=torch.long, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden = 2048, 256
    scores = torch.rand(tokens, 16, device="cuda", generator=g)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(4, dim=1).indices, True)
    probs = torch.softmax(scores, dim=1) * routing_map
    x = torch.randn(tokens, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(3, hidden, hidden, device="cuda", generator=g, dtype=torch.bfloat16) / 16

    def round_trip(postprocess, static):
        xs, ps, ws = x.clone().requires_grad_(True), probs.clone().requires_grad_(True), w.clone().requires_grad_(True)
        d.routing_map, d.moe_sft_static_rows = routing_map, static
        rows, counts, local_probs = postprocess(d, xs, ps)
        ends = counts.to("cuda").cumsum(0).to(torch.int32)
        h = F.grouped_mm(rows, ws, offs=ends) * local_probs.unsqueeze(-1).to(rows.dtype)
        out = d.combine_preprocess(h)
        out.float().square().sum().backward()
        return out.detach(), xs.grad, ps.grad, ws.grad

    assert token_dispatcher.unpermute is ours.unpermute  # kernels installed by _moe_layer
    round_trip(ours._allgather_postprocess, True)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mine = round_trip(ours._allgather_postprocess, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = round_trip(ours._allgather_postprocess, False)
    assert torch.equal(mine[0], ref[0])
    for a, b in zip(mine[1:], ref[1:]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-3)
    assert d.moe_sft_excess.item() == 0
    # Above the capacity (0.75x the expected rows here): cut, recorded on the device, still no host sync
    routed = int(routing_map[:, 2:5].sum())
    d.moe_sft_capacity = 0.75
    capacity = ours.static_rows_count(tokens, d, 0.75)
    assert capacity < routed
    torch.cuda.set_sync_debug_mode("error")
    try:
        cut = round_trip(ours._allgather_postprocess, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert d.moe_sft_excess.item() == routed - capacity
    assert all(torch.isfinite(t).all() for t in cut)
