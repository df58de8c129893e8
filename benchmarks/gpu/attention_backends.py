"""Packed causal attention on one GPU: torch's flash kernels against flash-attn-4 and cuDNN's fused attention.

For the benchmark's packs (benchmarks/benchmark.py's documents, 4096 and 8192 tokens) and the two head
layouts the trainer sees (Qwen3's GQA 32/4 x 128; DeepSeek-V3's MLA, q/k 192 and v 128), prints
per backend the error of the output and of dq/dk/dv against an fp32 per-document SDPA, and the
forward and forward+backward time (CUDA events) with the causal TFLOP/s they imply.

cuDNN's ragged (THD) path gave the right output but was far slower than flash and gave wrong
dq/dk/dv (docs/log.md), so the trainer keeps the flash kernels. torch's own varlen_attn has this
cuDNN path switched off (`_should_use_cudnn` returns False).

Arms: `torch` (torch's flash varlen kernel as the trainer calls it, model.attention_kernel=torch),
`fa4` (flash-attn-4's `flash_attn.cute.flash_attn_varlen_func`, where it imports: install it with
benchmarks/gpu/fa4_wheels.sh and fa4_stage.sh; its first call of a shape JIT-compiles, which the
timing's warm-up calls absorb) and `cudnn`.

    python3 benchmarks/gpu/attention_backends.py
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from benchmarks.ceilings import seconds_per_call
from benchmarks.workload import Workload
from moe_sft.layers import attention


class _CudnnVarlen(torch.autograd.Function):
    """Causal varlen attention through cuDNN's fused attention (aten `_cudnn_attention_forward` /
    `_cudnn_attention_backward` with ragged cu_seqlens). Arguments by schema name: the backward's
    order differs from flash's, and a defined but empty `attn_bias` is taken for a real one."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, True, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed, offset)
        ctx.sizes = (max_seqlen_q, max_seqlen_k, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed, offset = ctx.saved_tensors
        max_seqlen_q, max_seqlen_k, scale = ctx.sizes
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad_out=grad_out.contiguous(),
            query=q,
            key=k,
            value=v,
            out=out,
            logsumexp=lse,
            philox_seed=seed,
            philox_offset=offset,
            attn_bias=None,
            cum_seq_q=cu_seqlens_q,
            cum_seq_k=cu_seqlens_k,
            max_q=max_seqlen_q,
            max_k=max_seqlen_k,
            dropout_p=0.0,
            is_causal=True,
            scale=scale,
        )
        return dq, dk, dv, None, None, None, None, None


def cudnn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    return _CudnnVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)


def _docs(budget: int) -> list[int]:
    mb = Workload(budget=budget, micro_batches=1, vocab=1000).global_batch(0)[0]
    cu = mb.cu_seqlens.tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _reference(q, k, v, cu, scale):
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=torch.float32)
    groups = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1], cu[1:]):
        qd, kd, vd = (t[a:b].float().transpose(0, 1) for t in (q, k, v))
        kd, vd = kd.repeat_interleave(groups, 0), vd.repeat_interleave(groups, 0)
        out[a:b] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(0, 1)
    return out


def run_case(name, budget, hq, hkv, dqk, dv, backends):
    torch.manual_seed(0)
    lens = _docs(budget)
    cu_list = [0]
    for n in lens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    t, maxlen, scale = cu_list[-1], max(lens), dqk**-0.5
    q = torch.randn(t, hq, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, hkv, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, hkv, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(t, hq, dv, device="cuda", dtype=torch.bfloat16)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = _reference(qf, kf, vf, cu_list, scale)
    ref.backward(grad.float())
    causal_pairs = sum(n * (n + 1) / 2 for n in lens)
    fwd_flops = 2 * causal_pairs * hq * (dqk + dv)
    rows = []
    for backend, fn in backends.items():
        row = {"case": name, "backend": backend, "tokens": t, "docs": len(lens), "max_doc": maxlen}
        try:
            call = lambda: fn(q, k, v, cu, cu, maxlen, maxlen, scale)  # noqa: E731
            out = call()
            dq, dk, dvv = torch.autograd.grad(out, (q, k, v), grad)
            for key, got, want in (("out", out, ref), ("dq", dq, qf.grad), ("dk", dk, kf.grad), ("dv", dvv, vf.grad)):
                row[f"err_{key}"] = float((got.detach().float() - want).abs().max() / want.abs().max())
            with torch.no_grad():
                fwd_ms = seconds_per_call(call, "cuda", 3, 20) * 1e3
            both_ms = seconds_per_call(lambda: torch.autograd.grad(call(), (q, k, v), grad), "cuda", 3, 20) * 1e3
            row.update(
                fwd_ms=round(fwd_ms, 3),
                fwd_bwd_ms=round(both_ms, 3),
                fwd_tflops=round(fwd_flops / fwd_ms / 1e9, 1),
                fwd_bwd_tflops=round(3.5 * fwd_flops / both_ms / 1e9, 1),
            )
        except Exception as exc:  # a backend that refuses a shape is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    for op in ("_cudnn_attention_forward", "_cudnn_attention_backward"):
        print(getattr(torch.ops.aten, op).default._schema)
    attention.set_attention_kernel("torch")  # the `torch` arm: torch's kernel even where flash-attn imports
    backends = {"torch": attention._varlen_cuda}
    if attention.fa4_varlen_func is not None:
        backends["fa4"] = attention.fa4_varlen
    else:
        print(f"flash-attn-4 does not import ({attention._FA4_IMPORT_ERROR}): no fa4 arm")
    backends["cudnn"] = cudnn_varlen
    for budget in (4096, 8192):
        run_case(f"gqa32/4x128@{budget}", budget, 32, 4, 128, 128, backends)
    run_case("mla16x192/128@4096", 4096, 16, 16, 192, 128, backends)
    return 0


if __name__ == "__main__":
    sys.exit(main())
