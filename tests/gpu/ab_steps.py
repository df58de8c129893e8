"""Interleaved A/B of a kernel switch: the same model, data and process, the two sides alternating.

The timed step is host-bound (docs/benchmarks.md), and H200 machines of one kind time the same code
0.59-0.76 s apart, so an A/B across runs or machines measures the machine. Here one benchmark
model (tools/benchmark.py's moe-sft arm) trains `--rounds` rounds; each round runs `--steps` timed
steps with the switch on and as many with it off, the order flipping every round.

Usage: python3 tests/gpu/ab_steps.py --switch router_topk [--model qwen3_30b --layers 8 --budget 4096
       --tokens-per-step 32768 --rounds 4 --steps 3 --out DIR]
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# name: (module, attribute, value that turns it off)
SWITCHES = {
    "router_topk": ("moe_sft.layers.router_topk", "triton", None),  # off: megatron's torch ops
    "wgrad_overlap": ("moe_sft.layers.wgrad", "OVERLAP", False),    # off: the compute stream
}


def _allocator_counts(device: str) -> tuple[int, int]:
    if device != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    p.add_argument("--model", default="qwen3_30b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--tokens-per-step", type=int, default=32768)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("ab_out"))
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (not a timing)")
    args = p.parse_args()

    from moe_sft.bench.measure import _sync
    from moe_sft.bench.ours import OursArm
    from moe_sft.bench.workload import Workload, hf_config

    module_name, attr, off_value = SWITCHES[args.switch]
    module = importlib.import_module(module_name)
    on_value = getattr(module, attr)
    work = Workload(budget=args.budget, micro_batches=args.tokens_per_step // args.budget,
                    vocab=hf_config(args.model, args.layers)[1].vocab_size)
    total = args.warmup + 2 * args.rounds * args.steps
    arm = OursArm(args.model, args.layers, args.out / "work", ep=1, first=work, max_steps=total, device=args.device)
    arm.use(work)
    times, losses, step = {"on": [], "off": []}, {"on": [], "off": []}, 0
    # per timed step: the allocator's cudaMalloc calls and retries (a retry frees the cache and waits)
    allocator = {"device_allocs": [], "alloc_retries": []}
    for side in ["on", "off"] * ((args.warmup + 1) // 2):  # warm both paths (Triton compiles)
        setattr(module, attr, on_value if side == "on" else off_value)
        arm.prepare(step)
        arm.step(step)
        step += 1
    for r in range(args.rounds):
        for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
            setattr(module, attr, on_value if side == "on" else off_value)
            for _ in range(args.steps):
                arm.prepare(step)
                _sync(arm.device)
                before = _allocator_counts(arm.device)
                start = time.perf_counter()
                losses[side].append(arm.step(step))
                _sync(arm.device)
                times[side].append(time.perf_counter() - start)
                after = _allocator_counts(arm.device)
                allocator["device_allocs"].append(after[0] - before[0])
                allocator["alloc_retries"].append(after[1] - before[1])
                step += 1
    setattr(module, attr, on_value)
    result = {"switch": args.switch, "model": args.model, "layers": args.layers, "budget": args.budget,
              "tokens_per_step": args.tokens_per_step, "step_seconds": times, "losses": losses,
              "allocator": allocator, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
              "median_s": {k: statistics.median(v) for k, v in times.items()},
              "device": torch.cuda.get_device_name() if arm.device == "cuda" else arm.device}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ab_{args.switch}.json").write_text(json.dumps(result, indent=1))
    on, off = result["median_s"]["on"], result["median_s"]["off"]
    print(f"[ab] {args.switch}: median step on {on:.4f} s, off {off:.4f} s ({(off / on - 1) * 100:+.1f}% "
          f"slower off); cudaMalloc calls per step {allocator['device_allocs']}, retries "
          f"{sum(allocator['alloc_retries'])}; steps on {[round(t, 3) for t in times['on']]} off {[round(t, 3) for t in times['off']]}")
    arm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
