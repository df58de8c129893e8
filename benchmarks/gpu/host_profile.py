"""Where the host's time goes in a training step: cProfile over timed steps of the benchmark model.

The step is host-bound (docs/benchmarks.md), so the Python and dispatcher time per step decides
the step time. cProfile slows Python calls, so read shares, not absolute times. Writes the top
functions by own time and by cumulative time to OUT/host_profile.txt.
Usage: python3 benchmarks/gpu/host_profile.py OUT [--model qwen3_30b --layers 8 --budget 4096 --steps 2]
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu.bench_model import add_model_args, build_arm  # noqa: E402


def step_anatomy(arm, steps) -> list[dict]:
    """Wall time of the parts of `Trainer.train_one_step` (forward-backward, the loss all-reduce,
    the optimizer with its grad norm, the rest), each between synchronisations, so that the host
    time of a part that waits on the GPU's result shows."""
    from benchmarks.measure import _sync
    from moe_sft.trainer import guard, trainer

    parts, rows = {}, []

    def timed(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*a, **kw):
            _sync(arm.device)
            start = time.perf_counter()
            out = original(*a, **kw)
            _sync(arm.device)
            parts[label] = parts.get(label, 0.0) + time.perf_counter() - start
            return out

        setattr(owner, name, wrapper)
        return owner, name, original

    patched = [
        timed(trainer.train_step, "run_forward_backward", "forward_backward"),
        timed(trainer.train_step, "global_loss", "loss_allreduce"),
        timed(guard, "step_unless_non_finite", "optimizer"),
        timed(arm.trainer.telemetry, "step_metrics", "telemetry"),
    ]
    try:
        for step in steps:
            arm.prepare(step)
            parts.clear()
            _sync(arm.device)
            start = time.perf_counter()
            arm.step(step)
            _sync(arm.device)
            total = time.perf_counter() - start
            rows.append({"step": total, **parts, "rest": total - sum(parts.values())})
    finally:
        for owner, name, original in patched:
            if owner is arm.trainer.telemetry:
                del owner.step_metrics  # the instance attribute shadowed the method
            else:
                setattr(owner, name, original)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--callees", nargs="*", default=[], help="also list what these functions call (regexes)")
    p.add_argument("--callers", nargs="*", default=[], help="also list who calls these functions (regexes)")
    args = p.parse_args()

    from benchmarks.measure import _sync

    arm = build_arm(args, args.out / "work", max_steps=args.warmup + 1 + 2 * args.steps)
    for step in range(args.warmup):
        arm.prepare(step)
        arm.step(step)
    arm.prepare(args.warmup)
    _sync(arm.device)
    start = time.perf_counter()
    arm.step(args.warmup)
    _sync(arm.device)
    plain = time.perf_counter() - start
    anatomy = step_anatomy(arm, range(args.warmup + 1, args.warmup + 1 + args.steps))
    profiler = cProfile.Profile()
    start = time.perf_counter()
    for step in range(args.warmup + 1, args.warmup + 1 + args.steps):
        arm.prepare(step)
        profiler.enable()
        arm.step(step + args.steps)
        _sync(arm.device)
        profiler.disable()
    profiled = (time.perf_counter() - start) / args.steps
    text = io.StringIO()
    text.write("step anatomy, ms per part of each step (a synchronisation before and after each part):\n")
    for row in anatomy:
        text.write("  " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row.items()) + "\n")
    text.write(f"step without cProfile {plain:.3f} s, with {profiled:.3f} s; stats summed over {args.steps} steps\n")
    for key in ("tottime", "cumulative"):
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats(key).print_stats(70)
    stats = pstats.Stats(profiler, stream=text)
    for pattern in args.callees:
        stats.print_callees(pattern)
    for pattern in args.callers:
        stats.print_callers(pattern)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_profile.txt").write_text(text.getvalue())
    print(text.getvalue()[:3000])
    arm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
