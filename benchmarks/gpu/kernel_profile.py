"""The CUDA kernels of a training step: torch.profiler over timed steps of the benchmark model,
the top kernels by total GPU time and the step's wall and kernel time, written to OUT/kernels.txt.
Usage: python3 benchmarks/gpu/kernel_profile.py OUT [--model qwen3_30b --layers 4 --budget 4096 --lora]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu.bench_model import add_model_args, build_arm  # noqa: E402


def main(argv=None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    arm = build_arm(args, args.out / "work", max_steps=args.warmup + args.steps)
    for step in range(args.warmup):
        arm.step(step)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for step in range(args.warmup, args.warmup + args.steps):
            arm.step(step)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    events = prof.key_averages()
    kernel_us = sum(e.device_time_total for e in events) / args.steps
    table = events.table(sort_by="device_time_total", row_limit=25, max_name_column_width=90)
    text = f"step wall {wall * 1e3:.1f} ms, kernels {kernel_us / 1e3:.1f} ms per step\n{table}\n"
    (args.out / "kernels.txt").write_text(text)
    print(text)
    arm.close()


if __name__ == "__main__":
    main()
