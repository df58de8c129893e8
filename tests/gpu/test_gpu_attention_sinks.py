"""One GPU: gpt-oss attention through torch's flash varlen kernel, with the causal sliding window
and the sink folded in from the kernel's log-sum-exp (moe_sft/layers/attention_sinks.py), and
through flash-attn-4's own window and sink where it is installed (`kernel` "fa4"), against
the exact fp32 reference on the same bf16 inputs: packed documents, GQA, values and the gradients
of q, k, v and the sinks. The CPU suite proves the fold's algebra with a stand-in kernel; this
checks the real kernel's window convention, lse layout and bf16 accuracy."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

LENGTHS = (300, 77, 1, 190)  # documents longer and shorter than the window
HQ, HKV, DIM = 8, 2, 64


@pytest.fixture(params=["torch", "fa4"], autouse=True)
def kernel(request):
    """Each test under torch's kernel (the sink folded in) and under flash-attn-4 (its own sink)."""
    from moe_sft.layers import attention

    if request.param == "fa4" and attention.fa4_varlen_func is None:
        pytest.skip("flash-attn-4 is not installed: the torch run covers this machine's kernel")
    attention.set_attention_kernel(request.param)
    yield request.param
    attention.set_attention_kernel("auto")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# (window, sink): plain causal attention without a sink is tests/gpu/test_gpu_cp_attention.py's
@pytest.mark.parametrize(("window", "with_sink"), [(None, True), (31, True), (31, False)])
def test_flash_kernel_with_window_and_folded_sink_equals_the_exact_reference(window, with_sink):
    from moe_sft.layers.attention import _varlen_cuda
    from moe_sft.layers.attention_sinks import sink_attention_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)
    cu = torch.tensor([0, *LENGTHS], device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(total, h, DIM, device="cuda", generator=g, dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
    sink = torch.randn(HQ, device="cuda", generator=g, dtype=torch.bfloat16) if with_sink else None
    grad = torch.randn(total, HQ, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = DIM**-0.5

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        s = sink.detach().to(dtype).requires_grad_(True) if with_sink else None
        out = fn(*leaves, s)
        out.backward(grad.to(dtype))
        return [out.detach(), *(t.grad for t in leaves), s.grad if with_sink else None]

    ours = run(lambda a, b, c, s: _varlen_cuda(a, b, c, cu, cu, max(LENGTHS), max(LENGTHS), scale, s, window), q.dtype)
    ref = run(lambda a, b, c, s: sink_attention_reference(a, b, c, cu, cu, scale, s, window), torch.float32)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), ours, ref):
        if b is None:
            continue
        assert _rel(a, b) <= 2e-2, (name, _rel(a, b))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [None, 31])
def test_context_parallel_sink_attention_equals_the_exact_reference(cp, window):
    """CP ranks simulated as in tests/gpu/test_gpu_cp_attention.py: every rank's query chunks
    against the gathered keys through the flash kernel (bottom-right causal window, sink folded
    from the lse over the query's whole key prefix), against the exact reference over whole
    documents. The sink's gradient is the sum of every rank's share."""
    import functools

    from moe_sft.layers.attention import cp_kernel
    from moe_sft.layers.attention_sinks import sink_attention_reference
    from moe_sft.layers.context_parallel import attention_on_gathered_kv, local_token_index, plan_cp_attention

    lengths = [-(-n // (2 * cp)) * 2 * cp for n in LENGTHS]  # CP pads each document to 2·cp chunks
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(cu[-1], h, DIM, device="cuda", generator=g, dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
    sink = torch.randn(HQ, device="cuda", generator=g, dtype=torch.bfloat16)
    grad = torch.randn(cu[-1], HQ, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = DIM**-0.5

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sink)]
    cq, ck, cv, cs = leaves
    index = [local_token_index(cu, cp, r).cuda() for r in range(cp)]
    k_all, v_all = torch.cat([ck[i] for i in index]), torch.cat([cv[i] for i in index])
    kernel = functools.partial(cp_kernel, sink=cs, window=window)
    out = torch.zeros(cu[-1], HQ, DIM, device="cuda", dtype=torch.bfloat16)
    for r in range(cp):
        plan = plan_cp_attention(cu, cp, r).to("cuda")
        out = out.index_put((index[r],), attention_on_gathered_kv(cq[index[r]], k_all, v_all, plan, scale, kernel))
    out.backward(grad)
    ours = [out.detach(), *(t.grad for t in leaves)]

    ref_leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v, sink)]
    cu_t = torch.tensor(cu, device="cuda")
    ref_out = sink_attention_reference(*ref_leaves[:3], cu_t, cu_t, scale, ref_leaves[3], window)
    ref_out.backward(grad.float())
    ref = [ref_out.detach(), *(t.grad for t in ref_leaves)]
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), ours, ref):
        assert _rel(a, b) <= 2e-2, (cp, window, name, _rel(a, b))
