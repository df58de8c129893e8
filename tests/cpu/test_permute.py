"""moe_sft.kernels.permute against megatron-core's own permute/unpermute: same rows, same order,
same gradients."""

import pytest
import torch
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from moe_sft.config import layout
from moe_sft.kernels import permute as ours


def _routing(num_tokens=37, num_experts=8, topk=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    chosen = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, chosen, True)
    routing_map[::5] = False  # padding tokens: routed nowhere
    routing_map[3, :] = False
    routing_map[3, 1] = True  # a token with fewer rows than top-k (a local-expert slice)
    probs = torch.softmax(scores, dim=1) * routing_map
    return routing_map, probs


def _round_trip(permute, unpermute, x, routing_map, probs, weight_rows, with_probs):
    x = x.clone().requires_grad_(True)
    p = probs.clone().requires_grad_(True) if with_probs else None
    rows, permuted_probs, sorted_indices = permute(x, routing_map, probs=p, num_out_tokens=int(routing_map.sum()))
    h = rows * weight_rows  # a row-dependent change, like the experts'
    out = unpermute(h, sorted_indices, x.shape, probs=p, routing_map=routing_map)
    (out * torch.linspace(-1, 2, out.numel()).view_as(out)).sum().backward()
    return rows, permuted_probs, sorted_indices, out, x.grad, (p.grad if with_probs else None)


def _matches_megatron(permute, routing_map, probs):
    """Round trips through `permute` + our unpermute and through megatron's, with and without
    probs: every output and gradient equal in fp64. Returns ours (with probs)."""
    x = torch.randn(routing_map.shape[0], 16, dtype=torch.float64)
    weight_rows = torch.randn(int(routing_map.sum()), 1, dtype=torch.float64)
    for with_probs in (False, True):
        mine = _round_trip(permute, ours.unpermute, x, routing_map, probs, weight_rows, with_probs)
        ref = _round_trip(moe_utils.permute, moe_utils.unpermute, x, routing_map, probs, weight_rows, with_probs)
        for a, b in zip(mine, ref):
            if b is None:
                assert a is None
            else:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    return mine


def test_permute_and_unpermute_equal_megatron_values_and_gradients():
    routing_map, probs = _routing()
    mine = _matches_megatron(ours.permute, routing_map, probs)
    # padding tokens get nothing back and no gradient
    assert torch.count_nonzero(mine[3][::5]) == 0 and torch.count_nonzero(mine[4][::5]) == 0


def _topk_routing(num_tokens=41, num_experts=8, topk=3, seed=2):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map.scatter_(1, scores.topk(topk, dim=1).indices, True)
    return routing_map, torch.softmax(scores, dim=1) * routing_map


def test_exact_topk_path_without_host_syncs_equals_megatron():
    """The dispatcher's dropless row count (TopKRows) selects the static-size path: same rows,
    order, probs and gradients as megatron's permute/unpermute."""
    routing_map, probs = _topk_routing()
    count = ours.TopKRows(int(routing_map.sum()))

    def tagged(tokens, rmap, probs=None, num_out_tokens=None):
        return ours.permute(tokens, rmap, probs=probs, num_out_tokens=count)

    mine = _matches_megatron(tagged, routing_map, probs)
    assert mine[2]._moe_sft_slots.shape == (routing_map.shape[0], 3)  # slot width is top-k, not read back


def test_exact_topk_path_refuses_a_token_with_another_count():
    routing_map, _ = _topk_routing()
    routing_map[5, routing_map[5].nonzero()[0]] = False
    with pytest.raises(RuntimeError, match="exactly top-k"):
        ours.permute(
            torch.randn(routing_map.shape[0], 4), routing_map, num_out_tokens=ours.TopKRows(routing_map.shape[0] * 3)
        )


def test_counted_rows_path_equals_megatron():
    """A row count read once from the device with the slot width (the allgather dispatcher's local
    slice: padding tokens with no rows, tokens with fewer than top-k) selects the static-size path:
    same rows, order, probs and gradients as megatron's permute/unpermute."""
    routing_map, probs = _routing()
    count = ours.CountedRows(int(routing_map.sum()), 3)

    def tagged(tokens, rmap, probs=None, num_out_tokens=None):
        return ours.permute(tokens, rmap, probs=probs, num_out_tokens=count)

    mine = _matches_megatron(tagged, routing_map, probs)
    assert mine[2]._moe_sft_slots.shape == (routing_map.shape[0], 3)


def _local_slice_dispatcher():
    """An allgather dispatcher holding experts 2-4 (as a rank at EP > 1), and a routing of 29 tokens."""
    from moe_sft.runtime import device as rdevice
    from tests.cpu.test_plan import _reset_world

    rdevice.prepare_runtime(rdevice.RuntimeChoice("cpu", "fp32", "torch", ()))
    try:
        moe = _moe_layers("allgather")[0]
    finally:
        _reset_world()
    d = moe.token_dispatcher
    d.local_expert_indices, d.num_local_experts = [2, 3, 4], 3
    return (d, *_routing(num_tokens=29, num_experts=d.config.num_moe_experts, topk=d.router_topk, seed=3))


def test_allgather_postprocess_equals_megatron_s_for_a_local_expert_slice(monkeypatch):
    """The allgather dispatcher's permutation for this rank's experts (as at EP > 1: a slice of the
    gathered routing map) and its combine: same rows, counts, probs, output and gradients as
    megatron's own postprocess with megatron's permute/unpermute."""
    d, routing_map, probs = _local_slice_dispatcher()
    x = torch.randn(29, 16, dtype=torch.float64)
    weight_rows = torch.randn(int(routing_map[:, 2:5].sum()), 1, dtype=torch.float64)

    def round_trip(postprocess):
        xs, ps = x.clone().requires_grad_(True), probs.double().clone().requires_grad_(True)
        d.routing_map = routing_map
        rows, counts, local_probs = postprocess(d, xs, ps)
        out = d.combine_preprocess(rows * weight_rows * local_probs.unsqueeze(-1))
        (out * torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return rows, counts.long().cpu(), local_probs, out, xs.grad, ps.grad

    monkeypatch.setattr(token_dispatcher, "unpermute", ours.unpermute)
    mine = round_trip(ours._allgather_postprocess)
    assert isinstance(d.reversed_local_input_permutation_mapping._moe_sft_slots, torch.Tensor)
    monkeypatch.setattr(token_dispatcher, "permute", moe_utils.permute)
    monkeypatch.setattr(token_dispatcher, "unpermute", moe_utils.unpermute)
    ref = round_trip(ours._megatron_allgather_postprocess)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_static_rows_equal_megatron_s_and_their_padding_reaches_nothing(monkeypatch):
    """Static rows (no host wait): the routed rows first, as megatron's, then padding up to tokens x
    min(top-k, local experts). The experts' stand-in writes NaN into every padding row, as a grouped
    GEMM leaves those rows unwritten; the output, the tokens' and the probs' gradients still equal
    megatron's exactly, and the padding's probs are 0."""
    d, routing_map, probs = _local_slice_dispatcher()
    d.moe_sft_capacity, d.moe_sft_excess = 2.0, torch.zeros((), dtype=torch.long)
    count, bound = int(routing_map[:, 2:5].sum()), ours.static_rows_count(29, d, 2.0)
    assert count < bound <= 29 * min(d.router_topk, 3)
    x = torch.randn(29, 16, dtype=torch.float64)
    weight_rows = torch.randn(bound, 1, dtype=torch.float64)
    weight_rows[count:] = float("nan")

    def round_trip(postprocess, static):
        xs, ps = x.clone().requires_grad_(True), probs.double().clone().requires_grad_(True)
        d.routing_map, d.moe_sft_static_rows = routing_map, static
        rows, counts, local_probs = postprocess(d, xs, ps)
        out = d.combine_preprocess(rows * weight_rows[: rows.shape[0]] * local_probs.unsqueeze(-1))
        (out * torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return rows, counts.long().cpu(), local_probs, out, xs.grad, ps.grad

    monkeypatch.setattr(token_dispatcher, "unpermute", ours.unpermute)
    rows, counts, local_probs, *results = round_trip(ours._allgather_postprocess, True)
    assert rows.shape[0] == local_probs.shape[0] == bound and not local_probs[count:].any()
    assert int(rows._moe_sft_rows_bound) == count  # where the bounded kernels stop (bounded_rows.py)
    monkeypatch.setattr(token_dispatcher, "permute", moe_utils.permute)
    monkeypatch.setattr(token_dispatcher, "unpermute", moe_utils.unpermute)
    ref_rows, ref_counts, ref_probs, *ref = round_trip(ours._megatron_allgather_postprocess, False)
    assert torch.equal(counts, ref_counts) and torch.equal(rows[:count], ref_rows)
    assert torch.equal(local_probs[:count], ref_probs)
    for a, b in zip(results, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert int(d.moe_sft_excess) == 0


def test_static_rows_above_their_capacity_keep_megatron_s_first_rows_and_record_the_excess(monkeypatch):
    """Routing that sends a rank more rows than its capacity: the permutation holds megatron's first
    `capacity` rows (expert-major), the expert counts are cut to add up to them (the grouped GEMMs
    stay in bounds), every kept row's token and prob are megatron's, and the excess is recorded for
    the trainer, which then runs the step again (tests/dist/test_expert_parallel.py)."""
    d, routing_map, probs = _local_slice_dispatcher()
    count = int(routing_map[:, 2:5].sum())
    d.routing_map, d.moe_sft_static_rows = routing_map, True
    d.moe_sft_capacity, d.moe_sft_excess = (count - 5) / (29 * d.router_topk * 3 / d.config.num_moe_experts), None
    capacity = ours.static_rows_count(29, d, d.moe_sft_capacity)
    assert count - 5 <= capacity < count
    d.moe_sft_excess = torch.tensor(2)  # an earlier layer call's smaller excess is kept as the max
    x = torch.randn(29, 16, dtype=torch.float64)
    rows, counts, local_probs = ours._allgather_postprocess(d, x, probs.double())
    ref_counts = routing_map[:, 2:5].sum(dim=0).long()
    ref_rows = x.index_select(0, routing_map[:, 2:5].T.nonzero()[:, 1])
    ref_probs = probs.double()[:, 2:5].T[routing_map[:, 2:5].T.bool()]
    assert rows.shape[0] == local_probs.shape[0] == capacity and int(counts.sum()) == capacity
    assert int(rows._moe_sft_rows_bound) == capacity
    assert torch.equal(counts, torch.diff(ref_counts.cumsum(0).clamp(max=capacity), prepend=torch.zeros(1).long()))
    assert torch.equal(rows, ref_rows[:capacity]) and torch.equal(local_probs, ref_probs[:capacity])
    assert int(d.moe_sft_excess) == count - capacity


def test_static_rows_are_capped_at_twice_the_expected_rows():
    """A rank's worst case is EP x min(top-k, local experts) / top-k times its expected rows; static
    rows hold at most the capacity (2x by default), whatever the EP (experts without biases or
    adapters: the trainer's EP2 runs log it, tests/dist/test_expert_parallel.py compares them with
    one rank, there with the capacity cut to 1x too)."""
    padding = ours.static_rows_bound

    assert padding(2, 8, 64) == 2.0 and padding(4, 8, 32) == 2.0  # Qwen3-30B-A3B at EP2 / EP4 (worst: 4x)
    assert ours.static_rows_worst(4, 8, 32) == 4.0 and padding(4, 8, 32, capacity=3.0) == 3.0
    assert padding(8, 8, 1) == 1.0  # one expert per rank: at most one row per token
    assert padding(2, 2, 4) == 2.0  # the tiny test models at EP2
    assert padding(2, 2, 4, capacity=1.0) == 1.0
    # eagerly up to 8192 gathered tokens per rank (EP2 x 4096; above it the step is GPU-bound and
    # measured slower: EP2 x 8192, EP4 x 4096), any size with CUDA graphs
    apply = layout.static_rows_apply
    assert apply(2 * 4096) and not apply(2 * 8192)
    assert not apply(4 * 4096) and apply(4 * 4096, graphed=True)


def test_bf16_merge_is_deterministic_and_no_less_accurate_than_megatron():
    routing_map, _ = _routing(num_tokens=256, num_experts=16, topk=8, seed=1)
    x = torch.randn(256, 64, dtype=torch.bfloat16)
    rows, _, idx = ours.permute(x, routing_map)
    assert torch.equal(rows, moe_utils.permute(x, routing_map)[0])
    first = ours.unpermute(rows, idx, x.shape, routing_map=routing_map)
    again = ours.unpermute(rows, idx, x.shape, routing_map=routing_map)
    assert torch.equal(first, again)
    truth = x.double() * routing_map.sum(1, keepdim=True)
    err_ours = (first.double() - truth).abs().max()
    err_megatron = (moe_utils.unpermute(rows, idx, x.shape, routing_map=routing_map).double() - truth).abs().max()
    assert err_ours <= err_megatron


def test_gather_sum_adds_the_named_rows_in_slot_order_and_skips_empty_slots():
    from moe_sft.kernels.gather_sum import gather_sum

    src = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([[4, -1, 0], [-1, -1, -1], [5, 5, 2]])
    expected = torch.stack([src[4] + src[0], torch.zeros(5, dtype=torch.float64), 2 * src[5] + src[2]])
    assert torch.equal(gather_sum(src, index), expected)
    assert gather_sum(src, index[:, :0]).count_nonzero() == 0  # no slots at all: zeros
    # no rows at all (an EP rank whose experts got no token: EP2 of the tiny GLM-4.5 crashed here)
    assert torch.equal(gather_sum(src[:0], torch.full((3, 2), -1)), torch.zeros(3, 5, dtype=torch.float64))
    half = src.to(torch.bfloat16)
    exact = half.double().index_select(0, index.clamp_min(0).flatten()).view(3, 3, 5)
    exact = (exact * (index >= 0).unsqueeze(-1)).sum(1)
    assert torch.equal(gather_sum(half, index), exact.to(torch.bfloat16))  # one rounding of an fp32 sum


def test_identity_chunk_order_is_not_copied_and_other_orders_are_megatron_s():
    x = torch.randn(10, 4)
    sizes = torch.tensor([3, 0, 7])
    same, _ = ours.sort_chunks_by_idxs(x, sizes, torch.tensor([0, 1, 2]))
    assert same is x
    swapped, _ = ours.sort_chunks_by_idxs(x, sizes, torch.tensor([2, 1, 0]))
    torch.testing.assert_close(swapped, moe_utils.sort_chunks_by_idxs(x, sizes, torch.tensor([2, 1, 0]))[0])
    torch.testing.assert_close(swapped, torch.cat([x[3:], x[:3]]))


def test_the_dispatchers_use_it_once_megatron_fixes_are_applied():
    from moe_sft.config import KernelsConfig
    from moe_sft.kernels import install
    from moe_sft.runtime import megatron_fixes

    megatron_fixes.apply_megatron_fixes()
    install.install(KernelsConfig())
    assert token_dispatcher.permute is ours.permute
    assert token_dispatcher.unpermute is ours.unpermute
    assert token_dispatcher.sort_chunks_by_idxs is ours.sort_chunks_by_idxs


def test_unpermute_reuses_the_slots_permute_computed(monkeypatch):
    routing_map, _ = _routing()
    x = torch.randn(routing_map.shape[0], 8)
    rows, _, idx = ours.permute(x, routing_map)
    calls = []
    original = ours._rows_and_slots
    monkeypatch.setattr(ours, "_rows_and_slots", lambda m: calls.append(1) or original(m))
    cached = ours.unpermute(rows, idx, x.shape, routing_map=routing_map)
    assert calls == []
    fresh = ours.unpermute(rows, idx.clone(), x.shape, routing_map=routing_map)  # e.g. megatron's own indices
    assert calls == [1]
    assert torch.equal(cached, fresh)


def _moe_layers(dispatcher: str, layers: int = 1):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_sft.models import qwen3_moe
    from tests.cpu.test_plan import build_rank

    torch.manual_seed(0)
    model = build_rank(
        qwen3_moe.FAMILY, qwen3_moe.tiny_hf_config(num_hidden_layers=layers), 0, 1, dispatcher=dispatcher
    )[0]
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _moe_layer_output_and_grads(dispatcher: str, num_tokens: int, moe=None):
    moe = moe or _moe_layers(dispatcher)[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(num_tokens, 1, moe.config.hidden_size, generator=g).to(torch.bfloat16).requires_grad_(True)
    out, _ = moe(x)
    out.float().square().sum().backward()
    grads = {n: p.main_grad if getattr(p, "main_grad", None) is not None else p.grad for n, p in moe.named_parameters()}
    return moe.token_dispatcher, out, x.grad, grads


def test_alltoall_dispatcher_at_ep1_skips_the_host_copy_and_matches_allgather():
    """megatron's alltoall dispatcher (the GPU default) at EP x TP = 1: dropless row count tagged,
    no device-to-host copy or wait scheduled; same output and gradients as the allgather one."""
    from moe_sft.kernels import install as kernels_install
    from moe_sft.runtime import device as rdevice
    from tests.cpu.test_plan import _reset_world

    rdevice.prepare_runtime(rdevice.RuntimeChoice("cpu", "fp32", "torch", ()))
    kernels_install.install()
    try:
        a2a, out, x_grad, grads = _moe_layer_output_and_grads("alltoall", 23)
        assert isinstance(a2a.num_out_tokens, ours.TopKRows)
        assert int(a2a.num_out_tokens) == 23 * a2a.config.moe_router_topk
        assert a2a.cuda_dtoh_point == a2a.cuda_sync_point == "no_sync"
        _, ref_out, ref_x_grad, ref_grads = _moe_layer_output_and_grads("allgather", 23)
    finally:
        _reset_world()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(x_grad, ref_x_grad, rtol=0, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=0, msg=name)


def test_a_deeper_model_built_later_trains_with_megatron_s_aux_loss_tracker():
    """megatron's aux-loss tracker is process-global and sized by the first model that logs; the
    builder resets it, else layer 2 of a later, deeper model indexes past its end."""
    from moe_sft.kernels import install as kernels_install
    from moe_sft.runtime import device as rdevice
    from tests.cpu.test_plan import _reset_world

    rdevice.prepare_runtime(rdevice.RuntimeChoice("cpu", "fp32", "torch", ()))
    kernels_install.install()
    try:
        for layers in (1, 2):
            for moe in _moe_layers("allgather", layers):
                _moe_layer_output_and_grads("allgather", 9, moe)
    finally:
        _reset_world()


def test_the_pipeline_schedule_trains_after_a_backward_outside_it():
    """A MoE backward outside megatron's schedule leaves a 0-d aux-loss scale behind; a model built
    afterwards must still train through the schedule (the builder resets it)."""
    from moe_sft.kernels import install as kernels_install
    from moe_sft.models import qwen3_moe
    from moe_sft.runtime import device as rdevice
    from tests.cpu.test_plan import _reset_world, build_rank
    from tests.train_steps import adam_steps, random_batches

    rdevice.prepare_runtime(rdevice.RuntimeChoice("cpu", "fp32", "torch", ()))
    kernels_install.install()
    try:
        _moe_layer_output_and_grads("allgather", 9)
        model = build_rank(qwen3_moe.FAMILY, qwen3_moe.tiny_hf_config(vocab_size=300), 0, 1)[0]
        losses, _ = adam_steps(model, random_batches(300, (24, 31)), 300, "cpu", steps=2, lr=1e-3)
    finally:
        _reset_world()
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)
