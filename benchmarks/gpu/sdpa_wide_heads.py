"""Per-document SDPA at Gemma 4's full-attention shape (16 query heads, 2 KV heads, head dim 512):
the 3-D call the trainer made before against the 4-D call it makes now (`layers/attention.py`
`sdpa_varlen_reference`, the path for heads no flash kernel takes).

For each call shape: whether SDPA's memory-efficient kernel accepts it (forced through
`sdpa_kernel`), the error of out / dq / dk / dv against an fp32 math-backend reference, and the
forward + backward time over one packed 4096-token micro-batch. No model, one GPU:

    python3 benchmarks/gpu/sdpa_wide_heads.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.ceilings import seconds_per_call

LENGTHS = (1800, 900, 600, 400, 250, 146)  # one 4096-token pack, the benchmark's long-tailed mix
HEADS, KV_HEADS, DIM = 16, 2, 512


def per_document(q, k, v, four_d: bool):
    out = torch.empty_like(q)
    start = 0
    for n in LENGTHS:
        qd = q[start : start + n].transpose(0, 1)
        kd = k[start : start + n].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)
        vd = v[start : start + n].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)
        if four_d:
            od = F.scaled_dot_product_attention(qd[None], kd[None], vd[None], is_causal=True, scale=1.0)[0]
        else:
            od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=1.0)
        out[start : start + n] = od.transpose(0, 1)
        start += n
    return out


def run(q, k, v, grad, four_d: bool):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = per_document(q, k, v, four_d)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    t = sum(LENGTHS)
    # q/k are RMS-normed in Gemma 4 (scale 1.0): unit-variance rows keep the logits in range
    q = torch.randn(t, HEADS, DIM, device="cuda", generator=g) / DIM**0.25
    k = torch.randn(t, KV_HEADS, DIM, device="cuda", generator=g) / DIM**0.25
    v = torch.randn(t, KV_HEADS, DIM, device="cuda", generator=g)
    grad = torch.randn(t, HEADS, DIM, device="cuda", generator=g)
    with sdpa_kernel([SDPBackend.MATH]):
        reference = run(q, k, v, grad, four_d=True)
    bf = [x.bfloat16() for x in (q, k, v, grad)]
    for four_d in (False, True):
        row = {"call": "4-D" if four_d else "3-D"}
        try:
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                run(*bf, four_d=four_d)
            row["memory_efficient_kernel"] = "accepted"
        except RuntimeError as error:
            row["memory_efficient_kernel"] = f"refused: {str(error).splitlines()[0][:120]}"
        got = run(*bf, four_d=four_d)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, reference):
            row[f"{name}_max_abs_err"] = float((a.float() - b).abs().max())
        row["fwd_bwd_ms"] = round(1e3 * seconds_per_call(lambda: run(*bf, four_d=four_d), "cuda", 1, 10), 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
