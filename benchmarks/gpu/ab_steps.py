"""Interleaved A/B of a kernel switch: the same model, data and process, the two sides alternating.

The timed step is host-bound (docs/benchmarks.md), and machines of one kind time the same code
far apart, so an A/B across runs or machines measures the machine; within one process the host's
speed drifts too (docs/log.md). Here one benchmark model
(benchmarks/benchmark.py's moe-sft arm) trains `--pairs` pairs of back-to-back steps, one with the switch
on and one off, the order flipping every pair; the median of the pairs' time ratios is the result.

Usage: python3 benchmarks/gpu/ab_steps.py --switch router_topk [--model qwen3_30b --layers 8 --budget 4096
       --tokens-per-step 32768 --pairs 12 --out DIR]
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
from benchmarks.gpu.bench_model import add_model_args, build_arm  # noqa: E402


class _ThroughTriton(dict):
    """A launch cache that never hits: every Triton launch goes through Triton's own entry."""

    def get(self, key, default=None):
        return None

    def __setitem__(self, key, value):
        pass


class _TorchVarlenAttn:
    apply = None  # set below: torch's public varlen_attn in place of the direct flash call


def _off_values():
    from moe_sft.layers import attention

    _TorchVarlenAttn.apply = staticmethod(attention.torch_varlen_attn)
    return {
        "router_topk": None,
        "wgrad_overlap": False,
        "triton_launch": _ThroughTriton(),
        "flash_direct": _TorchVarlenAttn,
        "topk_rows": None,
        "one_rank_collectives": lambda group: False,
        "cuda_graphs": False,
        "loss_rows": False,
        "triton_adam": False,
        "adam_writes_bf16": False,
    }


# name: (module, attribute); the value that turns it off comes from _off_values()
SWITCHES = {
    "router_topk": ("moe_sft.kernels.router_topk", "triton"),  # off: megatron's torch ops
    "wgrad_overlap": ("moe_sft.kernels.wgrad", "OVERLAP"),  # off: the compute stream
    "triton_launch": ("moe_sft.kernels.triton_launch", "_cache"),  # off: Triton's JIT entry each launch
    "flash_direct": ("moe_sft.layers.attention", "_FlashVarlen"),  # off: torch's varlen_attn custom op
    "topk_rows": ("moe_sft.kernels.topk_rows", "triton"),  # off: the permutation's torch ops
    "one_rank_collectives": ("moe_sft.kernels.one_rank_collectives", "_one_rank"),  # off: megatron's Functions
    "cuda_graphs": ("moe_sft.trainer.cuda_graphs", "REPLAY"),  # off: the captured layers run eagerly
    "loss_rows": ("moe_sft.trainer.loss_rows", "ENABLED"),  # off: the LM head over every position
    "triton_adam": ("moe_sft.kernels.optimizer", "ENABLED"),  # off: clip multiply + torch's fused Adam
    "adam_writes_bf16": ("moe_sft.kernels.optimizer", "WRITE_MODEL_PARAMS"),  # off: megatron's copy_
}


def _allocator_counts(device: str) -> tuple[int, int]:
    if device != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    add_model_args(p)
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path("ab_out"))
    args = p.parse_args()

    from benchmarks.measure import _sync

    module_name, attr = SWITCHES[args.switch]
    off_value = _off_values()[args.switch]
    module = importlib.import_module(module_name)
    on_value = getattr(module, attr)
    args.cuda_graphs = args.switch == "cuda_graphs"  # the graphs must exist to be switched
    arm = build_arm(args, args.out / "work", max_steps=args.warmup + 1 + 2 * args.pairs)
    times, losses, step = {"on": [], "off": []}, {"on": [], "off": []}, 0
    # per timed step: the allocator's cudaMalloc calls and retries (a retry frees the cache and waits)
    allocator = {"device_allocs": [], "alloc_retries": []}
    for side in ["on", "off"] * ((args.warmup + 1) // 2):  # warm both paths (Triton compiles)
        setattr(module, attr, on_value if side == "on" else off_value)
        arm.prepare(step)
        arm.step(step)
        step += 1
    for r in range(args.pairs):  # pairs of adjacent steps, the order flipping every pair
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            setattr(module, attr, on_value if side == "on" else off_value)
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
    result = {
        "switch": args.switch,
        "model": args.model,
        "layers": args.layers,
        "budget": args.budget,
        "tokens_per_step": args.tokens_per_step,
        "step_seconds": times,
        "losses": losses,
        "allocator": allocator,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        # each pair's two steps ran back to back: their ratio cancels the host's slow drift
        "median_pair_ratio_off_over_on": statistics.median(off / on for on, off in zip(times["on"], times["off"])),
        "device": torch.cuda.get_device_name() if arm.device == "cuda" else arm.device,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ab_{args.switch}.json").write_text(json.dumps(result, indent=1))
    on, off = result["median_s"]["on"], result["median_s"]["off"]
    pair = result["median_pair_ratio_off_over_on"]
    print(
        f"[ab] {args.switch}: median step on {on:.4f} s, off {off:.4f} s; median of the pairs' off/on "
        f"{pair:.3f} ({(pair - 1) * 100:+.1f}% slower off); cudaMalloc calls per step {allocator['device_allocs']}, retries "
        f"{sum(allocator['alloc_retries'])}; steps on {[round(t, 3) for t in times['on']]} off {[round(t, 3) for t in times['off']]}"
    )
    arm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
