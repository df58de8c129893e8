"""One GPU: flash-attn-4 (`flash_attn.cute.flash_attn_varlen_func`) as `VarlenCoreAttention`'s kernel.

Skipped where flash-attn-4 does not import (benchmarks/gpu/fa4_wheels.sh and fa4_stage.sh install
it) or the GPU is not SM90 / SM100. bf16-aware tolerance, as tests/gpu/test_gpu_cp_attention.py:
FA4's error against an fp32 reference on the same bf16 inputs must stay within 2x the error of
torch's varlen kernel on the same call, plus a floor. Packed documents; Qwen3-30B-A3B's GQA shape
(32 q / 4 kv heads x 128) and DeepSeek-V3's MLA head dims (q/k 192, v 128); sinks, windows and
queries that are the tail of longer keys (the CP layout) against the exact reference; the module
under `auto`; and one forward + backward captured in a CUDA graph, replayed against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
DOCS = [1000, 37, 2047, 513, 1]


@pytest.fixture(autouse=True)
def attention():
    from moe_sft.layers import attention

    if attention.fa4_varlen_func is None:
        pytest.skip(f"flash-attn-4 does not import ({attention._FA4_IMPORT_ERROR})")
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        pytest.skip(f"flash-attn-4 runs on SM90 / SM100, this GPU is SM{major}{minor}")
    yield attention
    attention.set_attention_kernel("auto")


def _cu(docs, device="cuda"):
    return torch.tensor([0, *docs], device=device).cumsum(0).to(torch.int32)


def _inputs(hq, hkv, dk, dv, tq, tk=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tk = tq if tk is None else tk
    q = torch.randn(tq, hq, dk, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(tk, hkv, dk, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(tk, hkv, dv, device="cuda", generator=g).to(torch.bfloat16)
    grad = torch.randn(tq, hq, dv, device="cuda", generator=g).to(torch.bfloat16)
    return q, k, v, grad


def _run(fn, tensors, grad, dtype=None):
    """(out, dq, dk, dv[, dsink]) of fn on fresh leaves (cast to dtype, e.g. fp32 for a reference)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize(("hq", "hkv", "dk", "dv"), [(32, 4, 128, 128), (16, 16, 192, 128)])  # Qwen3 GQA; MLA
def test_fa4_matches_fp32_reference_as_well_as_torch_kernel(attention, hq, hkv, dk, dv):
    cu, n, scale = _cu(DOCS), max(DOCS), dk**-0.5
    q, k, v, grad = _inputs(hq, hkv, dk, dv, sum(DOCS))

    def torch_kernel(q, k, v):  # torch's flash kernel needs equal head dims: v zero-padded (exact)
        vv = F.pad(v, (0, dk - dv)) if dv != dk else v
        return attention.torch_varlen_attn(q, k, vv, cu, cu, n, n, scale)[..., :dv]

    fa4 = _run(lambda q, k, v: attention.fa4_varlen(q, k, v, cu, cu, n, n, scale), (q, k, v), grad)
    ours = _run(torch_kernel, (q, k, v), grad)
    ref = _run(lambda q, k, v: attention.sdpa_varlen_reference(q, k, v, cu, scale), (q, k, v), grad, torch.float32)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), fa4, ours, ref):
        e_fa4, e_torch = _err(a, r), _err(b, r)
        print(
            f"{hq}/{hkv} x {dk}/{dv} {name}: FA4 error {e_fa4:.3e}, torch's {e_torch:.3e} (max |ref| {r.abs().max():.2f})"
        )
        assert e_fa4 <= 2 * e_torch + 1e-3 * r.abs().max().item(), name


@pytest.mark.parametrize(
    ("window", "with_sink", "kv_offset"),
    [(None, True, 0), (31, True, 0), (31, False, 0), (None, False, 64), (31, True, 64)],
)
def test_fa4_sinks_windows_and_cp_layout_match_the_exact_reference(attention, window, with_sink, kv_offset):
    """Sinks and windows as `sink_attention_reference` defines them (the sink an unscaled logit,
    masks bottom-right aligned), also where every segment's queries are the last of its keys
    (kv_offset more keys than queries: the context-parallel layout). torch's path: the sink
    folded from its flash kernel's lse (`SinkFlashVarlen`)."""
    from moe_sft.layers.attention_sinks import sink_attention_reference

    hq, hkv, d, scale = 8, 2, 64, 64**-0.5
    cu_q = _cu(DOCS)
    cu_k = cu_q + torch.arange(len(DOCS) + 1, device="cuda", dtype=torch.int32) * kv_offset
    q, k, v, grad = _inputs(hq, hkv, d, d, int(cu_q[-1]), int(cu_k[-1]))
    sink = torch.randn(hq, device="cuda").to(torch.bfloat16) * 2 if with_sink else None
    args = (cu_q, cu_k, max(DOCS), max(DOCS) + kv_offset, scale)
    tensors = (q, k, v) + ((sink,) if with_sink else ())

    def split(fn):
        return lambda q, k, v, s=None: fn(q, k, v, s)

    fa4 = _run(split(lambda q, k, v, s: attention.fa4_varlen(q, k, v, *args, s, window)), tensors, grad)
    ours = _run(split(lambda q, k, v, s: attention._flash_varlen(q, k, v, *args, s, window)), tensors, grad)
    ref = _run(
        split(lambda q, k, v, s: sink_attention_reference(q, k, v, cu_q, cu_k, scale, s, window)),
        tensors,
        grad,
        torch.float32,
    )
    for name, a, b, r in zip(("out", "dq", "dk", "dv", "dsink"), fa4, ours, ref):
        e_fa4, e_torch = _err(a, r), _err(b, r)
        print(f"window={window} sink={with_sink} kv_offset={kv_offset} {name}: FA4 {e_fa4:.3e}, torch's {e_torch:.3e}")
        assert e_fa4 <= 2 * e_torch + 1e-3 * r.abs().max().item(), name


def test_module_under_auto_runs_fa4(attention, monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    calls = []
    real = attention.fa4_varlen_func
    monkeypatch.setattr(attention, "fa4_varlen_func", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    attention.set_attention_kernel("auto")
    assert attention.attention_kernel_name("cuda").startswith("flash-attn-4")
    config = TransformerConfig(
        num_layers=1, hidden_size=4096, num_attention_heads=32, num_query_groups=4, kv_channels=128,
        params_dtype=torch.bfloat16, attention_dropout=0.0,
    )  # fmt: skip
    module = attention.VarlenCoreAttention(config, 1, AttnMaskType.causal, "self")
    cu = _cu(DOCS)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(DOCS))
    q, k, v, grad = _inputs(32, 4, 128, 128, sum(DOCS))
    got = _run(lambda q, k, v: module(q, k, v, None, packed_seq_params=psp).view(q.shape), (q, k, v), grad)
    assert len(calls) == 1 and calls[0]["cu_seqlens_q"] is cu and calls[0]["causal"]
    ref = _run(lambda q, k, v: attention.sdpa_varlen_reference(q, k, v, cu, 128**-0.5), (q, k, v), grad, torch.float32)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert _err(a, r) <= 2e-2 * r.abs().max().item(), name


def test_fa4_forward_backward_replays_in_a_cuda_graph(attention):
    """After a warm-up (FA4 JIT-compiles on its first call), one forward + backward is captured
    and replayed: on the captured inputs, then on new values and new document boundaries (same
    count, the max length within the captured bound) copied into the same buffers. Eager runs
    give the expected values; dq/dk/dv are summed with fp32 atomics, so they may differ from
    eager in the last bit."""
    hq, hkv, d, scale = 32, 4, 128, 128**-0.5
    total, bound = sum(DOCS), max(DOCS)
    q, k, v, grad = _inputs(hq, hkv, d, d, total)
    cu = _cu(DOCS)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        out = attention.fa4_varlen(*leaves, cu, cu, bound, bound, scale)
        return (out, *torch.autograd.grad(out, leaves, grad))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch's CUDA graph docs do
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()

    other_docs = [2047, 1000, 1, 500]  # four documents + the rest in a fifth
    other_docs.append(total - sum(other_docs))
    new_q, new_k, new_v, new_grad = _inputs(hq, hkv, d, d, total, seed=1)
    for values, docs in (((q, k, v, grad), DOCS), ((new_q, new_k, new_v, new_grad), other_docs)):
        with torch.no_grad():
            for leaf, value in zip(leaves, values[:3]):
                leaf.copy_(value)
            grad.copy_(values[3])
            cu.copy_(_cu(docs))
        graph.replay()
        replayed = [t.clone() for t in static]
        eager = step()
        assert torch.equal(replayed[0], eager[0]), "forward"
        for name, a, b in zip(("dq", "dk", "dv"), replayed[1:], eager[1:]):
            torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7 * b.abs().max().item(), msg=name)
        ref = attention.sdpa_varlen_reference(*(t.detach().float() for t in leaves), cu, scale)
        assert _err(replayed[0], ref) <= 2e-2 * ref.abs().max().item()
