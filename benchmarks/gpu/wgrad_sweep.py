"""Times the grouped weight-gradient kernel (moe_sft/kernels/wgrad.py) over tile configurations at
the Qwen3-30B-A3B expert shapes of one 4096-token micro-batch, against the memory floor (read and
write the fp32 main grad once, read the inputs once) and against what it replaces (grouped_mm's
bf16 weight gradient + the fp32 add of DDP's hook). Usage: python benchmarks/gpu/wgrad_sweep.py"""

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import ceilings  # noqa: E402
from moe_sft.kernels import wgrad  # noqa: E402


def _time(fn) -> float:
    """Milliseconds per call (the ceilings' CUDA-event timer)."""
    return ceilings._time(fn, "cuda", warmup=1, iters=20) * 1e3


def main():
    tokens, experts, topk = 4096, 128, 8
    counts = torch.bincount(torch.rand(tokens, experts).topk(topk, dim=1).indices.flatten(), minlength=experts)
    ends = torch.cumsum(counts, 0, dtype=torch.int32).cuda()
    rows = int(counts.sum())
    bandwidth = 4.8e12  # H200 HBM3e peak, bytes/s
    print(f"{'shape':>12} {'tiles (K,N,M,warps,stages)':>28} {'ms':>7} {'floor ms':>8} {'old path ms':>11}")
    for k, n in ((2048, 1536), (768, 2048)):
        x = torch.randn(rows, k, device="cuda").bfloat16()
        dy = torch.randn(rows, n, device="cuda").bfloat16()
        out = torch.zeros(experts, k, n, device="cuda")
        floor = (out.numel() * 8 + (x.numel() + dy.numel()) * 2) / bandwidth * 1e3

        def old():  # bf16 weight gradient per expert, then the fp32 add
            w = F.grouped_mm(x.t(), dy, offs=ends)
            out.add_(w)

        try:
            old_ms = _time(old)
        except Exception as exc:  # grouped_mm's 2d x 2d (offsets on the shared dim) mode missing
            print("old path failed:", type(exc).__name__, exc)
            old_ms = float("nan")
        for bk, bn, bm, warps, stages in itertools.product((64, 128), (128, 256), (32, 64), (4, 8), (2, 3)):
            tiles = dict(BLOCK_K=bk, BLOCK_N=bn, BLOCK_M=bm, num_warps=warps, num_stages=stages)
            try:
                ms = _time(lambda: wgrad.accumulate_grouped_wgrad(x, dy, ends, out, tiles))
            except Exception as exc:  # out of shared memory / registers for this tile
                print(f"{k}x{n:>6} {str((bk, bn, bm, warps, stages)):>28} failed: {type(exc).__name__}")
                continue
            print(f"{k}x{n:>6} {str((bk, bn, bm, warps, stages)):>28} {ms:7.3f} {floor:8.3f} {old_ms:11.3f}")


if __name__ == "__main__":
    main()
