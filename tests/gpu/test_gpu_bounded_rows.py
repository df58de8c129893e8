"""One GPU: the row-wise kernels that stop at the routed rows (moe_sft/kernels/bounded_rows.py)
equal torch's ops on those rows, leave the padding rows unwritten, make no host sync, and a MoE
layer with static rows gives the same output and gradients with them as without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def _no_sync(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("rows,hidden,routed", [(6000, 2048, 3001), (513, 2880, 0), (513, 200, 513)])
def test_gather_rows_copies_the_routed_rows_and_leaves_the_padding_unwritten(rows, hidden, routed):
    from moe_sft.kernels import bounded_rows

    g = torch.Generator(device="cuda").manual_seed(rows + hidden)
    src = torch.randn(1000, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    index = torch.randint(0, 1000, (rows,), device="cuda", generator=g)
    bound = torch.tensor(routed, device="cuda")
    out = torch.full((rows, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    _no_sync(lambda: bounded_rows.gather_rows(src, index, bound, out=out))
    assert torch.equal(out[:routed], src.index_select(0, index[:routed]))
    assert out[routed:].isnan().all()
    assert torch.equal(bounded_rows.gather_rows(src, index, None), src.index_select(0, index))


@pytest.mark.parametrize("rows,ffn,routed", [(4096, 768, 2500), (1000, 2048, 1000), (300, 1500, 17)])
def test_swiglu_with_probs_equals_megatron_s_on_the_routed_rows(rows, ffn, routed):
    """Forward and backward against megatron GroupedMLP's compiled `activation_func_with_probs`
    (silu(gate) x up x prob, fp32, one rounding) and its autograd, on the rows below the bound."""
    from moe_sft.kernels import bounded_rows

    g = torch.Generator(device="cuda").manual_seed(rows)
    h = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    probs = torch.rand(rows, 1, device="cuda", generator=g)
    grad = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16, generator=g)
    bound = torch.tensor(routed, device="cuda")

    @torch.compile
    def megatron_s(x, p):  # megatron 0.16.1 experts.py: glu(x) * probs, then .to(x.dtype)
        gate, up = torch.chunk(x, 2, dim=-1)
        return (F.silu(gate) * up * p).to(x.dtype)

    def run(fn):
        x, p = h.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        out = fn(x, p)
        out.backward(grad)
        return out[:routed], x.grad[:routed], p.grad[:routed]

    ours = _no_sync(lambda: run(lambda x, p: bounded_rows.swiglu_with_probs(x, p, bound)))
    ref = run(megatron_s)
    exact = run(lambda x, p: F.silu(x[:, :ffn].double()) * x[:, ffn:].double() * p.double())
    for name, a, b, e in zip(("out", "grad h", "grad probs"), ours, ref, exact):
        assert a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2, msg=name)
        # as accurate as megatron's against the fp64 result, up to fp32 summation order (grad probs
        # sums ffn products per row)
        err, ref_err = (a.double() - e).abs().max(), (b.double() - e).abs().max()
        assert err <= ref_err * 1.01 + 4e-6 * e.abs().max(), (name, float(err), float(ref_err))


def test_a_moe_layer_with_static_rows_is_the_same_with_and_without_the_bounded_kernels():
    """A Qwen3-MoE layer with the allgather's static rows, its experts a local slice of 3 of the 16
    as at EP > 1 (so about half of its rows are padding): TorchGroupedMLP's forward and backward with
    the bounded gather and SwiGLU equal the same layer's with them switched off
    (`bounded_rows.ENABLED = False`: every padding row gathered and activated)."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from test_gpu_dispatch import _moe_layer, _run

    from moe_sft.kernels import bounded_rows, permute
    from moe_sft.layers.experts import TorchGroupedMLP

    moe = _moe_layer("allgather")
    d = moe.token_dispatcher
    d.local_expert_indices, d.num_local_experts = [2, 3, 4], 3
    torch.manual_seed(1)
    moe.experts = TorchGroupedMLP(3, moe.config, pg_collection=get_default_pg_collection())
    d.moe_sft_static_rows, d.moe_sft_capacity = True, 2.0
    d.moe_sft_excess = torch.zeros((), dtype=torch.long, device="cuda")
    tokens = 2048
    # 2x the expected tokens x 4 x 3 / 16 rows: about half of them padding
    assert permute.static_rows_count(tokens, d, 2.0) == tokens * 3 // 2
    x = torch.randn(
        tokens, 1, 256, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1)
    )
    ours = _run(moe, x)
    bounded_rows.ENABLED = False
    try:
        ref = _run(moe, x)
    finally:
        bounded_rows.ENABLED = True
    assert int(d.moe_sft_excess) == 0
    for a, b in zip([ours[0], ours[1], *ours[2]], [ref[0], ref[1], *ref[2]]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-3)
