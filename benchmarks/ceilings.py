"""Kernel ceilings on this device, at the model's shapes: what each phase could reach at best.

* dense bf16 matmul: a square 8192^3 (the device's practical peak) and the attention projection
  [T, H] x [H, (n_q + 2 n_kv) d] and LM head [T, H] x [H, V] shapes of the preset;
* `F.grouped_mm` through moe_sft.layers.experts.grouped_matmul (what TorchGroupedMLP runs) at the
  expert shapes: T x top-k routed rows spread evenly over the experts, fc1 [H -> 2F] and
  fc2 [F -> H], forward and forward + backward;
* varlen causal attention through moe_sft.layers.attention.cp_kernel (the kernel the model's core
  attention uses: torch's flash varlen kernel / flash-attn on CUDA, per-document SDPA on CPU) on one
  micro-batch of the benchmark workload and on equal 2048-token documents.

FLOPs: matmul 2mkn; attention 2 n_h (d_qk + d_v) per causal (query, key) pair; forward + backward
counted as 3 x forward, the model-FLOPs convention of moe_sft.trainer.flops (the flash backward
recomputes the scores, so hardware FLOPs are higher). Timing: CUDA events over `iters` calls
after `warmup` calls (wall clock on CPU).
"""

from __future__ import annotations

import time

import torch

from benchmarks.workload import Workload, hf_config, model_shape
from moe_sft.trainer import flops


def seconds_per_call(fn, device: str, warmup: int, iters: int) -> float:
    """Seconds per call of `fn` after `warmup` calls: CUDA events on the GPU, wall clock on CPU."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _row(kind: str, shape: str, flop: float, seconds: float, **extra) -> dict:
    return dict(kind=kind, shape=shape, tflop=flop / 1e12, ms=seconds * 1e3, tflops=flop / seconds / 1e12, **extra)


def matmul(m: int, k: int, n: int, dtype, device: str, warmup: int, iters: int, label: str) -> dict:
    a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
    return _row(
        "matmul",
        f"{label} [{m},{k}]x[{k},{n}]",
        2.0 * m * k * n,
        seconds_per_call(lambda: a @ b, device, warmup, iters),
    )


def grouped(
    tokens: int,
    topk: int,
    experts: int,
    hidden: int,
    ffn: int,
    dtype,
    device: str,
    warmup: int,
    iters: int,
    backward: bool,
) -> dict:
    from moe_sft.layers.experts import grouped_matmul

    rows = tokens * topk
    counts = torch.full((experts,), rows // experts, dtype=torch.long)
    counts[: rows - int(counts.sum())] += 1
    counts = counts.to(device)  # on the device, as the model's: no host-to-device copy per call
    x = torch.randn(rows, hidden, dtype=dtype, device=device, requires_grad=backward)
    w1 = (torch.randn(experts, hidden, 2 * ffn, dtype=dtype, device=device) * 0.02).requires_grad_(backward)
    w2 = (torch.randn(experts, ffn, hidden, dtype=dtype, device=device) * 0.02).requires_grad_(backward)
    grad = torch.randn(rows, hidden, dtype=dtype, device=device)

    def fwd():
        h = grouped_matmul(x, w1, counts)
        gate, up = h.chunk(2, dim=-1)
        return grouped_matmul(torch.nn.functional.silu(gate) * up, w2, counts)

    def fwd_bwd():
        fwd().backward(grad)

    flop = 3 * 2.0 * rows * hidden * ffn * (3 if backward else 1)
    shape = f"{experts} experts, {tokens}x top-{topk} rows, {hidden}->2x{ffn}->{hidden}"
    return _row(
        "grouped_mm" + (" fwd+bwd" if backward else " fwd"),
        shape,
        flop,
        seconds_per_call(fwd_bwd if backward else fwd, device, warmup, iters),
    )


def varlen(
    seqlens: list[int],
    heads: int,
    kv_heads: int,
    d_qk: int,
    d_v: int,
    dtype,
    device: str,
    warmup: int,
    iters: int,
    backward: bool,
    label: str,
) -> dict:
    from moe_sft.layers.attention import cp_kernel

    total = sum(seqlens)
    cu = torch.tensor([0] + seqlens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    q = torch.randn(total, heads, d_qk, dtype=dtype, device=device, requires_grad=backward)
    k = torch.randn(total, kv_heads, d_qk, dtype=dtype, device=device, requires_grad=backward)
    v = torch.randn(total, kv_heads, d_v, dtype=dtype, device=device, requires_grad=backward)
    grad = torch.randn(total, heads, d_v, dtype=dtype, device=device)
    longest, scale = max(seqlens), d_qk**-0.5

    def fwd():
        return cp_kernel(q, k, v, cu, cu, longest, longest, scale)

    def fwd_bwd():
        fwd().backward(grad)

    flop = 2.0 * heads * (d_qk + d_v) * flops.attention_pairs(seqlens) * (3 if backward else 1)
    shape = f"{label}: {len(seqlens)} docs / {total} tokens, {heads}/{kv_heads} heads, d {d_qk}/{d_v}"
    return _row(
        "varlen attention" + (" fwd+bwd" if backward else " fwd"),
        shape,
        flop,
        seconds_per_call(fwd_bwd if backward else fwd, device, warmup, iters),
    )


def run(model: str, budget: int, device: str, warmup: int = 3, iters: int = 10, log=print) -> list[dict]:
    """Every ceiling for preset `model` at `budget` tokens per micro-batch."""
    _, cfg = hf_config(model, 1)
    s = model_shape(model, 1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokens = budget
    rows = []

    def add(row):
        row.update(model=model, device=device, dtype=str(dtype).replace("torch.", ""))
        rows.append(row)
        log(f"[ceiling] {row['kind']:<26} {row['shape']:<70} {row['tflops']:8.4g} TFLOP/s ({row['ms']:.3f} ms)")

    square = 8192 if device == "cuda" else 256
    add(matmul(square, square, square, dtype, device, warmup, iters, "square"))
    if s.mla:  # the q down-projection (q_lora_rank) stands for MLA's projections
        add(matmul(tokens, s.hidden, s.mla.q_lora or s.hidden, dtype, device, warmup, iters, "MLA q down-projection"))
    else:
        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        add(matmul(tokens, s.hidden, qkv, dtype, device, warmup, iters, "attention qkv projection"))
    add(matmul(tokens, s.hidden, s.vocab, dtype, device, warmup, iters, "LM head"))
    for backward in (False, True):
        add(grouped(tokens, s.topk, s.num_experts, s.hidden, s.moe_ffn, dtype, device, warmup, iters, backward))
    d_qk, d_v = (s.mla.qk_nope + s.mla.qk_rope, s.mla.v_head) if s.mla else (s.head_dim, s.head_dim)
    workload_lens = [
        n for mb in Workload(budget, 1, cfg.vocab_size).global_batch(0) for n in flops.document_lengths(mb)
    ]
    even = [min(2048, budget)] * max(budget // 2048, 1)
    for label, lens in (("workload micro-batch", workload_lens), ("equal documents", even)):
        for backward in (False, True):
            add(varlen(lens, s.num_heads, s.num_kv_heads, d_qk, d_v, dtype, device, warmup, iters, backward, label))
    return rows
