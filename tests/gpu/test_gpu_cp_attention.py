"""One GPU: the context-parallel attention through the CUDA varlen kernel (flash-attn when it
imports, else torch's varlen_attn) with separate q/k cu_seqlens and its bottom-right causal mask.

CP ranks are simulated as in tests/cpu/test_context_parallel.py (no process group). bf16-aware
tolerance: the CP outputs' and gradients' error w.r.t. an fp64 CPU reference must stay within 2x
the error of the same kernel run without CP (one varlen call over whole documents), plus a floor.
A top-left aligned kernel would be off by O(1) (asserted on the reference path in the CPU test).
"""

from __future__ import annotations

import pytest
import torch

from moe_sft.layers.attention import attention_kernel_name, cp_kernel, sdpa_varlen_reference
from moe_sft.layers.context_parallel import attention_on_gathered_kv, local_token_index, plan_cp_attention

pytestmark = pytest.mark.gpu
DOCS = [1000, 37, 2047, 513, 1]
SCALE = 128**-0.5


def _padded_cu(cp):
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + -(-n // (2 * cp)) * 2 * cp)
    return cu


def _error(out, ref):
    return (out.double().cpu() - ref).abs().max().item()


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dk,dv", [(128, 128), (192, 128)])  # GQA; MLA's head dims
def test_cp_varlen_kernel_matches_reference(cp, dk, dv):
    print(f"kernel: {attention_kernel_name('cuda')}")
    cu = _padded_cu(cp)
    g = torch.Generator().manual_seed(0)
    hq, hkv = (8, 2) if dk == dv else (8, 8)
    q64, k64, v64 = (
        torch.randn(cu[-1], h, d, generator=g, dtype=torch.float64) for h, d in ((hq, dk), (hkv, dk), (hkv, dv))
    )
    w = torch.randn(cu[-1], hq, dv, generator=g, dtype=torch.float64)
    cu_t = torch.tensor(cu)

    ref_in = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    ref = sdpa_varlen_reference(*ref_in, cu_t, SCALE)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_in)

    def on_gpu():
        return [t.to("cuda", torch.bfloat16).requires_grad_() for t in (q64, k64, v64)]

    # without CP: one varlen call over whole documents
    full_in = on_gpu()
    cu_dev = cu_t.to("cuda", torch.int32)
    max_len = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    full = cp_kernel(*full_in, cu_dev, cu_dev, max_len, max_len, SCALE)
    full_grads = torch.autograd.grad((full.float() * w.to("cuda")).sum(), full_in)

    # CP: every simulated rank against the rank-major gathered K/V
    cp_in = on_gpu()
    q, k, v = cp_in
    index = [local_token_index(cu, cp, r).cuda() for r in range(cp)]
    k_all, v_all = torch.cat([k[i] for i in index]), torch.cat([v[i] for i in index])
    out = torch.zeros_like(full)
    for r in range(cp):
        plan = plan_cp_attention(cu, cp, r).to("cuda")
        out = out.index_put((index[r],), attention_on_gathered_kv(q[index[r]], k_all, v_all, plan, SCALE, cp_kernel))
    cp_grads = torch.autograd.grad((out.float() * w.to("cuda")).sum(), cp_in)

    err_full, err_cp = _error(full, ref), _error(out, ref)
    print(f"cp={cp} dk={dk} dv={dv}: output error vs fp64 {err_cp:.3e} (no CP: {err_full:.3e})")
    assert err_cp <= 2 * err_full + 1e-2
    for name, ours, base, r in zip("qkv", cp_grads, full_grads, ref_grads):
        e_cp, e_full = _error(ours, r), _error(base, r)
        print(f"  d{name} error {e_cp:.3e} (no CP: {e_full:.3e})")
        assert e_cp <= 2 * e_full + 5e-2 * r.abs().max().item()


@pytest.mark.parametrize("dk,dv,hq,hkv,kv_offset", [(128, 128, 32, 4, 0), (192, 128, 8, 8, 0), (128, 128, 8, 2, 64)])
def test_direct_flash_call_gives_torch_varlen_attn_s_bits(dk, dv, hq, hkv, kv_offset, request):
    """moe_sft's direct call of torch's flash kernels (`_FlashVarlen`) against torch's public
    varlen_attn: the same kernels, so the same output, dk and dv bits; dq is accumulated with fp32
    atomics in an order that changes from run to run (measured: one bf16 ulp apart, 1e-3 at 4.4),
    so it is held to one ulp. GQA, MLA's head dims (through the zero-padded v), and queries that
    are the tail of longer keys (the CP layout)."""
    from moe_sft.layers import attention

    if attention.varlen_attn is None:
        pytest.skip("torch has no varlen_attn to compare with")
    attention.set_attention_kernel("torch")  # no optional package: the direct torch call runs
    request.addfinalizer(lambda: attention.set_attention_kernel("auto"))
    g = torch.Generator(device="cuda").manual_seed(3)
    cu_q = torch.tensor([0] + list(torch.tensor(DOCS).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = cu_q + torch.arange(len(DOCS) + 1, device="cuda", dtype=torch.int32) * kv_offset
    q = torch.randn(int(cu_q[-1]), hq, dk, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(int(cu_k[-1]), hkv, d, device="cuda", generator=g).to(torch.bfloat16) for d in (dk, dv))
    grad = torch.randn(q.shape[0], hq, dv, device="cuda", generator=g).to(torch.bfloat16)
    max_q, max_k = max(DOCS), max(DOCS) + kv_offset

    def run(direct: bool):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        if direct:
            out = attention._varlen_cuda(*ins, cu_q, cu_k, max_q, max_k, SCALE)
        else:
            vv = torch.nn.functional.pad(ins[2], (0, dk - dv)) if dv != dk else ins[2]
            out = attention.torch_varlen_attn(ins[0], ins[1], vv, cu_q, cu_k, max_q, max_k, SCALE)[..., :dv]
        out.backward(grad)
        return [out] + [t.grad for t in ins]

    (out, dq, dk, dv), (ref_out, ref_dq, ref_dk, ref_dv) = run(True), run(False)
    assert torch.equal(out, ref_out) and torch.equal(dk, ref_dk) and torch.equal(dv, ref_dv)
    torch.testing.assert_close(dq, ref_dq, rtol=2**-7, atol=2**-7 * ref_dq.abs().max().item())
