"""The benchmark model the host-time scripts (ab_steps.py, host_profile.py) train: benchmarks/benchmark.py's
moe-sft arm on one GPU, its model and packed data chosen by the same arguments."""

import argparse
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3_30b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--tokens-per-step", type=int, default=32768)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cuda-graphs", action="store_true", help="trainer.cuda_graphs (the MoE halves as CUDA graphs)")
    p.add_argument("--lora", action="store_true", help="the LoRA arm (benchmarks/ours.py BENCH_LORA)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (not a timing)")


def build_arm(args, work_dir: Path, max_steps: int):
    """An OursArm built for the arguments' model and already using their workload."""
    from benchmarks.ours import BENCH_LORA, OursArm
    from benchmarks.workload import Workload, hf_config

    work = Workload(
        budget=args.budget,
        micro_batches=args.tokens_per_step // args.budget,
        vocab=hf_config(args.model, args.layers)[1].vocab_size,
    )
    arm = OursArm(
        args.model,
        args.layers,
        work_dir,
        ep=1,
        first=work,
        max_steps=max_steps,
        device=args.device,
        cuda_graphs=getattr(args, "cuda_graphs", False),
        lora=(BENCH_LORA.rank, BENCH_LORA.alpha) if getattr(args, "lora", False) else None,
    )
    arm.use(work)
    return arm
