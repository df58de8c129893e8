"""One GPU: the Gated DeltaNet layer with fla's kernels (varlen chunk_gated_delta_rule, causal_conv1d
with per-document reset) against the same layer's torch path, fp32 and bf16, forward and backward,
on packed documents that straddle the 64-token chunk (the layer's time: benchmarks/gpu/gdn_bench.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
LENGTHS = (1, 3, 63, 65, 130, 700)


@pytest.fixture(scope="module")
def gdn_layer():
    from moe_sft.layers import gated_delta_net as gdn
    from moe_sft.models import registry
    from moe_sft.models.builder import ModelOptions, build_transformer_config
    from moe_sft.runtime import distributed

    if not torch.cuda.is_available() or not gdn.fla_available():
        pytest.skip("needs CUDA and fla-core")
    distributed.init_process_group("cuda")
    distributed.init_model_parallel()
    family = registry.family_by_name("qwen3_5_moe")
    hf = family.tiny_hf_config(hidden_size=256, linear_key_head_dim=64, linear_value_head_dim=64)
    config = build_transformer_config(family, hf, ModelOptions(precision="fp32", backend="torch", device="cuda"))
    torch.manual_seed(0)
    return gdn, gdn.GatedDeltaNet(config, layer_number=1).cuda()


def _run(gdn, layer, x, params, use_fla):
    gdn.USE_FLA = use_fla
    try:
        layer.zero_grad(set_to_none=True)
        x = x.detach().clone().requires_grad_()
        out, _ = layer(x, packed_seq_params=params)
        weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
        (out.float() * weights).sum().backward()
        return out.detach().float(), x.grad.float(), {n: p.grad.float() for n, p in layer.named_parameters()}
    finally:
        gdn.USE_FLA = True


def _inputs(dtype, heads=4, dk=32, dv=32):
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = sum(LENGTHS)
    q = torch.nn.functional.normalize(torch.randn(tokens, heads, dk, device="cuda", generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(tokens, heads, dk, device="cuda", generator=g), dim=-1)
    v = torch.randn(tokens, heads, dv, device="cuda", generator=g)
    decay = -torch.rand(tokens, heads, device="cuda", generator=g)
    beta = torch.rand(tokens, heads, device="cuda", generator=g)
    cu = torch.tensor([0, *LENGTHS], device="cuda").cumsum(0).to(torch.int32)
    return q.to(dtype), k.to(dtype), v.to(dtype), decay, beta, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_forward_kernels_equal_the_torch_path(gdn_layer, dtype):
    """fla's varlen delta rule and causal conv1d (per-document reset) against the torch reference."""
    gdn, _ = gdn_layer
    q, k, v, decay, beta, cu = _inputs(dtype)
    with torch.no_grad():
        ref = gdn.gated_delta_rule_per_document(q.float(), k.float(), v.float(), decay, beta, cu)
        out, _ = gdn.fla_chunk_gated_delta_rule(
            q[None], k[None], v[None], g=decay[None], beta=beta[None], cu_seqlens=cu
        )
        x = torch.randn(q.shape[0], 24, device="cuda", dtype=dtype)
        w = torch.randn(24, 4, device="cuda", dtype=dtype)
        conv_ref = gdn.causal_conv_per_document(x.float(), w.float(), cu)
        conv = gdn.fla_causal_conv1d(x[None], weight=w, activation="silu", cu_seqlens=cu)[0][0]
    tol = 2e-3 if dtype == torch.float32 else 3e-2  # fla's chunked kernels run tf32 / bf16 dot products
    rel = lambda a, b: ((a.float() - b).abs().max() / (b.abs().max() + 1e-6)).item()  # noqa: E731
    print(f"{dtype}: delta rule {rel(out[0], ref):.2e}, conv {rel(conv, conv_ref):.2e}")
    assert rel(out[0], ref) <= tol and rel(conv, conv_ref) <= tol


def test_fla_layer_forward_and_backward_equal_the_torch_path(gdn_layer):
    """bf16, where the layer uses fla: its fused path (q/k L2 norm, GVA, decay and beta in the
    kernel, fla's gated RMSNorm) against the torch path on the same bf16 weights."""
    from moe_sft.models.forward import packed_batch

    gdn, layer = gdn_layer
    if not gdn.fla_trains():
        pytest.skip("fla refuses its backward on this GPU / Triton (fla issue #640): the layer runs the torch path")
    layer = layer.to(torch.bfloat16)
    try:
        _, _, params = packed_batch([[0] * n for n in LENGTHS], "cuda")
        x = torch.randn(sum(LENGTHS), 1, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        out_t, dx_t, grads_t = _run(gdn, layer, x, params, use_fla=False)
        out_f, dx_f, grads_f = _run(gdn, layer, x, params, use_fla=True)
    finally:
        layer.float()
    rel = lambda a, b: ((a - b).abs().max() / (b.abs().max() + 1e-6)).item()  # noqa: E731
    errors = {"out": rel(out_f, out_t), "dx": rel(dx_f, dx_t)} | {n: rel(grads_f[n], g) for n, g in grads_t.items()}
    print("bf16 fla vs torch:", " ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(e <= 3e-2 for e in errors.values()), errors  # bf16 rounding of two different orders


def test_fp32_layer_runs_the_torch_path(gdn_layer):
    """fp32 activations take the exact torch path on CUDA too (fla's fp32 backward of the decay
    was wrong on an H200: gated_delta_net._use_fla): fla on or off gives the same bits."""
    from moe_sft.models.forward import packed_batch

    gdn, layer = gdn_layer
    _, _, params = packed_batch([[0] * n for n in LENGTHS], "cuda")
    x = torch.randn(sum(LENGTHS), 1, layer.config.hidden_size, device="cuda")
    out_t, dx_t, grads_t = _run(gdn, layer, x, params, use_fla=False)
    out_f, dx_f, grads_f = _run(gdn, layer, x, params, use_fla=True)
    assert torch.equal(out_f, out_t) and torch.equal(dx_f, dx_t)
    assert all(torch.equal(grads_f[n], g) for n, g in grads_t.items())
