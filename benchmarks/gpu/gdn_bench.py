"""One Gated DeltaNet layer (moe_sft/layers/gated_delta_net.py, fla's kernels) forward + backward on
4096 packed bf16 tokens at Qwen3.5-35B-A3B's GDN widths (hidden 2048, 16 key / 32 value heads of
128), against fla's `chunk_gated_delta_rule` alone on the same heads, one JSON line:

    python -m benchmarks.gpu.gdn_bench
"""

from __future__ import annotations

import json
import time

import torch


def _time(step, iters: int = 20) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from moe_sft.layers.gated_delta_net import GatedDeltaNet
    from moe_sft.models import registry
    from moe_sft.models.builder import ModelOptions, build_transformer_config
    from moe_sft.models.forward import packed_batch
    from moe_sft.runtime import distributed

    distributed.init_process_group("cuda")
    distributed.init_model_parallel()
    family = registry.family_by_name("qwen3_5_moe")
    hf = family.tiny_hf_config(
        hidden_size=2048,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    config = build_transformer_config(family, hf, ModelOptions(precision="bf16", backend="torch", device="cuda"))
    layer = GatedDeltaNet(config, layer_number=1).cuda()
    lengths = [1024, 512, 2048, 512]
    _, _, params = packed_batch([[0] * n for n in lengths], "cuda")
    tokens = sum(lengths)
    x = torch.randn(tokens, 1, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    heads, dk, dv = 32, 128, 128
    q = (
        torch.nn.functional.normalize(torch.randn(1, tokens, heads, dk, device="cuda"), dim=-1)
        .bfloat16()
        .requires_grad_()
    )
    k = (
        torch.nn.functional.normalize(torch.randn(1, tokens, heads, dk, device="cuda"), dim=-1)
        .bfloat16()
        .requires_grad_()
    )
    v = torch.randn(1, tokens, heads, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g, beta = -torch.rand(1, tokens, heads, device="cuda"), torch.rand(1, tokens, heads, device="cuda")

    def layer_step():
        layer(x, packed_seq_params=params)[0].sum().backward()

    def kernel_step():
        chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=params.cu_seqlens_q)[0].sum().backward()

    mixed = torch.randn(tokens, 1, layer.in_proj.weight.shape[0], device="cuda", dtype=torch.bfloat16)
    attended = torch.randn(tokens, 1, layer.out_proj.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    mixed.requires_grad_(), attended.requires_grad_()

    def projections_step():  # the layer's two GEMMs, fwd + bwd: what no linear-attention kernel does
        (layer.in_proj(x)[0].float() * mixed).sum().backward()
        layer.out_proj(attended)[0].sum().backward()

    # transformers' own layer (fla's kernels, no cu_seqlens: one 4096-token sequence) on the same widths
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_modeling

    hf_layer = hf_modeling.Qwen3_5MoeGatedDeltaNet(hf, layer_idx=0).cuda().bfloat16()
    x_hf = x.detach().transpose(0, 1).clone().requires_grad_()

    def hf_step():
        hf_layer(x_hf).sum().backward()

    layer_ms, kernel_ms = _time(layer_step), _time(kernel_step)
    projections_ms, hf_ms = _time(projections_step), _time(hf_step)
    print(
        json.dumps(
            dict(
                bench="gdn_layer",
                device=torch.cuda.get_device_name(),
                tokens=tokens,
                layer_fwd_bwd_ms=layer_ms,
                transformers_layer_fwd_bwd_ms=hf_ms,
                projections_fwd_bwd_ms=projections_ms,
                fla_kernel_fwd_bwd_ms=kernel_ms,
                # the layer's time past its GEMMs against the bare kernel: the cost of everything
                # the layer wraps around fla (conv, norms, gates, layout)
                kernel_share_past_gemms=kernel_ms / max(layer_ms - projections_ms, 1e-9),
            )
        )
    )


if __name__ == "__main__":
    main()
