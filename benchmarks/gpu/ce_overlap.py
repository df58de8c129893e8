"""Can the EP dispatch's all-gather overlap the experts' GEMMs without slowing them? (issue 29)

The dispatch in token chunks (moe_sft/layers/split_dispatch.py) overlapped NCCL's all-gather and
reduce-scatter with the other chunk's grouped GEMMs and made the EP4 step slower: NCCL's kernels
hold SMs that the GEMMs need. A copy engine moves bytes between GPUs without SMs. This measures,
on every GPU of the host at once (one process, one side stream per GPU), at the Qwen3-30B-A3B EP4
shapes (a rank's 32 experts, 2048 -> 1536, over the 32,768 rows it gets from a 4096-token
micro-batch per rank; each rank's 4096 x 2048 bf16 tokens gathered by every other rank):

  gemm         the grouped GEMMs alone (`--gemms` fc1 forward calls back to back)
  nccl         NCCL's all-gather alone (torch.cuda.nccl, one communicator per GPU)
  ce           the same bytes by copy engines alone (peer copies into each GPU's gather buffer)
  gemm+nccl    both at once: the GEMMs' time on the compute stream, and the whole
  gemm+ce      both at once

    python3 benchmarks/gpu/ce_overlap.py [--tokens 4096 --iters 20 --gemms 4 --streams one|pair]

Prints one line per case: the compute stream's ms (GEMMs) and the wall ms of the iteration (from
one recorded point to the later of the two streams' ends; the host enqueues the transfers after
the GEMMs, so their enqueue time counts in the iteration, not the GEMMs), the medians over the
iterations, rank 0's streams timed by CUDA events, every GPU doing the same work.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank per micro-batch")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1536, help="fc1's output (gate and up)")
    p.add_argument("--experts", type=int, default=32, help="experts per rank")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--gemms", type=int, default=4, help="fc1 forward GEMMs per iteration")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--streams", default="pair", choices=("one", "pair"), help="copies on one side stream per GPU, or per peer"
    )
    args = p.parse_args()
    n = torch.cuda.device_count()
    if n < 2:
        raise SystemExit("needs 2 or more GPUs on this host")
    for i in range(n):
        for j in range(n):
            if i != j and not torch.cuda.can_device_access_peer(i, j):
                raise SystemExit(f"GPU {i} cannot access GPU {j} as a peer: no copy-engine path")
    rows = args.tokens * n * args.top_k // n  # the rows a rank's experts get, balanced
    devs = [torch.device("cuda", i) for i in range(n)]
    gen = torch.Generator().manual_seed(0)
    x = [torch.randn(rows, args.hidden, generator=gen).to(d, torch.bfloat16) for d in devs]
    w = [(torch.randn(args.experts, args.hidden, args.ffn, generator=gen) * 0.02).to(d, torch.bfloat16) for d in devs]
    offs = [torch.arange(1, args.experts + 1, dtype=torch.int32, device=d) * (rows // args.experts) for d in devs]
    mine = [torch.randn(args.tokens, args.hidden, generator=gen).to(d, torch.bfloat16) for d in devs]
    gathered = [torch.empty(n * args.tokens, args.hidden, dtype=torch.bfloat16, device=d) for d in devs]
    compute = [torch.cuda.Stream(d) for d in devs]
    side = [torch.cuda.Stream(d) for d in devs]
    # one stream per (source, destination) on each end, so the copies to different peers run on
    # different copy engines at once instead of queueing on one stream
    send = [[torch.cuda.Stream(devs[i]) for _ in range(n)] for i in range(n)]
    recv = [[torch.cuda.Stream(devs[j]) for _ in range(n)] for j in range(n)]

    def gemms(i):
        with torch.cuda.stream(compute[i]):
            for _ in range(args.gemms):
                F.grouped_mm(x[i], w[i], offs=offs[i])

    def nccl_gather():
        torch.cuda.nccl.all_gather(mine, gathered, streams=side)

    def ce_gather():
        if args.streams == "one":
            for i in range(n):
                for j in range(n):
                    with torch.cuda.stream(side[i]), torch.cuda.stream(side[j]):
                        gathered[j][i * args.tokens : (i + 1) * args.tokens].copy_(mine[i], non_blocking=True)
            return
        for i in range(n):
            for j in range(n):
                send[i][j].wait_stream(side[i])
                recv[j][i].wait_stream(side[j])
        for i in range(n):
            for j in range(n):
                # both devices' current streams set to streams of their own: torch's cross-device
                # copy syncs with the destination's current stream, which must not be the GEMMs'
                with torch.cuda.stream(send[i][j]), torch.cuda.stream(recv[j][i]):
                    gathered[j][i * args.tokens : (i + 1) * args.tokens].copy_(mine[i], non_blocking=True)
        for j in range(n):
            for i in range(n):
                side[j].wait_stream(recv[j][i])

    def run(case: str) -> tuple[float, float]:
        for d in devs:
            torch.cuda.synchronize(d)
        start = torch.cuda.Event(enable_timing=True)
        gemm_end = torch.cuda.Event(enable_timing=True)
        side_end = torch.cuda.Event(enable_timing=True)
        # both streams of rank 0 start from one recorded point
        torch.cuda.current_stream(devs[0]).record_event(start)
        for i in range(n):
            compute[i].wait_stream(torch.cuda.current_stream(devs[i]))
            side[i].wait_stream(torch.cuda.current_stream(devs[i]))
        if "gemm" in case:
            for i in range(n):
                gemms(i)
        # recorded before the transfers are enqueued: the host's time to enqueue them is not the GEMMs'
        compute[0].record_event(gemm_end)
        if "nccl" in case:
            nccl_gather()
        if "ce" in case:
            ce_gather()
        side[0].record_event(side_end)
        for d in devs:
            torch.cuda.synchronize(d)
        gemm_ms = start.elapsed_time(gemm_end)
        wall_ms = max(gemm_ms, start.elapsed_time(side_end))
        return gemm_ms, wall_ms

    ce_gather()
    for i in range(n):  # the copies put every rank's tokens in every gather buffer
        for j in range(n):
            got = gathered[j][i * args.tokens : (i + 1) * args.tokens].to(devs[0])
            assert torch.equal(got, mine[i].to(devs[0])), (i, j)
    results = {}
    for case in ("gemm", "nccl", "ce", "gemm+nccl", "gemm+ce"):
        for _ in range(3):
            run(case)
        times = [run(case) for _ in range(args.iters)]
        gemm_ms = statistics.median(t[0] for t in times)
        wall_ms = statistics.median(t[1] for t in times)
        results[case] = dict(gemm_ms=round(gemm_ms, 3), wall_ms=round(wall_ms, 3))
        print(f"{case:<10} compute stream {gemm_ms:7.3f} ms   iteration {wall_ms:7.3f} ms", flush=True)
    gathered_gb = n * (n - 1) * args.tokens * args.hidden * 2 / 1e9
    for case in ("nccl", "ce"):
        results[case]["gb_per_s_per_gpu"] = round(gathered_gb / n / (results[case]["wall_ms"] / 1e3), 1)
    base = results["gemm"]["gemm_ms"]
    for case in ("gemm+nccl", "gemm+ce"):
        results[case]["gemm_slowdown"] = round(results[case]["gemm_ms"] / base, 3)
    print(json.dumps(dict(gpus=n, rows_per_rank=rows, **results), indent=1))


if __name__ == "__main__":
    main()
