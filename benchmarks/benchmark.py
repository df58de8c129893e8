"""Training throughput of moe-sft against transformers, with a per-phase breakdown and kernel ceilings.

    python benchmarks/benchmark.py ceilings --model qwen3_30b --out DIR
    python benchmarks/benchmark.py compare  --model qwen3_30b --arms moe-sft,transformers --budgets 4096,8192 --out DIR
    python benchmarks/benchmark.py train    --arm moe-sft --model dsv3_reduced --budgets 4096,8192 --out DIR
    torchrun --nproc_per_node=4 benchmarks/benchmark.py train --arm moe-sft --model qwen3_30b --layers 24 --ep 4 \\
        --tokens-per-step 131072 --out DIR
    python benchmarks/benchmark.py report DIR

`train` runs one arm in this process (under torchrun for expert parallelism), each budget in turn:
warmup steps, timed steps, then profiled steps for the phase breakdown. `compare` runs each arm
in its own child process on CUDA (a clean CUDA context, its own peak memory, an OOM cannot take
the other arm down) and in this process on CPU (`--in-process` forces it). Every invocation merges
its results into DIR/benchmark.json and rewrites DIR/benchmark.md, then prints the tables.
Method, formulas and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# -graphs: trainer.cuda_graphs (the MoE half, adapters included); -lora: LoRA (--lora-rank, --lora-alpha)
# on attention and experts, base frozen (ours.BENCH_LORA); -lora-fp8: the same on a base kept in FP8
# (peft.fp8_base); transformers-peft: peft's LoRA of the same rank and alpha (hf.py)
ARMS = (
    "moe-sft",
    "moe-sft-graphs",
    "moe-sft-lora",
    "moe-sft-lora-fp8",
    "moe-sft-lora-graphs",
    "moe-sft-lora-fp8-graphs",
    "transformers",
    "transformers-peft",
    "torchtitan",
)


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def _common(parser: argparse.ArgumentParser) -> None:
    from benchmarks.workload import PRESETS

    parser.add_argument("--model", default="qwen3_30b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's, sized for one H200)")
    parser.add_argument("--budgets", default="4096,8192", help="tokens per packed micro-batch, comma-separated")
    parser.add_argument(
        "--tokens-per-step",
        type=int,
        default=32768,
        help="tokens per optimizer step over all GPUs (micro-batches = this / budget)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per budget")
    parser.add_argument("--profile-steps", type=int, default=2, help="profiled steps per budget (0: no phases)")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size (moe-sft and torchtitan arms; run under torchrun)"
    )
    parser.add_argument(
        "--dispatcher",
        default="auto",
        choices=("auto", "alltoall", "allgather"),
        help="moe-sft arms: model.moe_token_dispatcher_type",
    )
    parser.add_argument(
        "--static-rows-capacity",
        type=float,
        default=2.0,
        help="moe-sft arms: model.moe_static_rows_capacity (static rows' cap, x a rank's expected rows)",
    )
    parser.add_argument(
        "--combine-dtype",
        default="bf16",
        choices=("fp32", "bf16"),
        help="moe-sft arms: model.moe_combine_dtype (the allgather combine's reduce-scatter)",
    )
    parser.add_argument(
        "--attention-kernel",
        default="auto",
        choices=("auto", "torch", "fa4"),
        help="moe-sft arms: model.attention_kernel",
    )
    parser.add_argument(
        "--dispatch-chunks",
        type=int,
        default=1,
        help="moe-sft arms: model.moe_dispatch_chunks (the allgather's collectives overlapped with other "
        "token chunks' experts; 1: off)",
    )
    parser.add_argument(
        "--padding-rows",
        default="skip",
        choices=("skip", "compute"),
        help="moe-sft arms, static rows: the row gathers and SwiGLU stop at the routed rows (skip) or "
        "run over the padding too (compute: the A/B of moe_sft/kernels/bounded_rows.py)",
    )
    parser.add_argument(
        "--static-rows",
        default="auto",
        choices=("auto", "on", "off"),
        help="moe-sft arms: the allgather's static local row count where its rule allows (auto), at any "
        "micro-batch size (on), or never (off: one host wait per layer)",
    )
    parser.add_argument(
        "--hf-attn", default="sdpa", help="transformers attn_implementation (sdpa | flex_attention | eager)"
    )
    parser.add_argument("--hf-experts", default="grouped_mm", help="transformers experts_implementation")
    parser.add_argument("--lora-rank", type=int, default=16, help="moe-sft-lora and transformers-peft: LoRA rank")
    parser.add_argument("--lora-alpha", type=float, default=32.0, help="moe-sft-lora and transformers-peft: LoRA alpha")

    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--seed", type=int, default=0, help="data seed")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "benchmark_out"))


def _forwarded(args) -> list[str]:
    argv = [
        "--model",
        args.model,
        "--budgets",
        args.budgets,
        "--tokens-per-step",
        str(args.tokens_per_step),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--profile-steps",
        str(args.profile_steps),
        "--ep",
        str(args.ep),
        "--dispatcher",
        args.dispatcher,
        "--static-rows",
        args.static_rows,
        "--static-rows-capacity",
        str(args.static_rows_capacity),
        "--combine-dtype",
        args.combine_dtype,
        "--dispatch-chunks",
        str(args.dispatch_chunks),
        "--attention-kernel",
        args.attention_kernel,
        "--padding-rows",
        args.padding_rows,
        "--hf-attn",
        args.hf_attn,
        "--hf-experts",
        args.hf_experts,
        "--lora-rank",
        str(args.lora_rank),
        "--lora-alpha",
        str(args.lora_alpha),
        "--device",
        args.device,
        "--seed",
        str(args.seed),
        "--out",
        str(args.out),
    ]
    return argv + (["--layers", str(args.layers)] if args.layers else [])


def _make_arm(name: str, args, device: str, layers: int, first):
    from benchmarks.workload import hf_config

    if name.startswith("moe-sft"):
        from benchmarks.ours import OursArm
        from moe_sft.config import layout
        from moe_sft.kernels import bounded_rows

        bounded_rows.ENABLED = args.padding_rows == "skip"
        if args.static_rows == "off":  # (with graphs they are on anyway: a graph needs them)
            layout.STATIC_ROWS_MAX_GATHERED = 0
        elif args.static_rows == "on":
            layout.STATIC_ROWS_MAX_GATHERED = 1 << 30
        budgets = [int(b) for b in args.budgets.split(",")]
        max_steps = len(budgets) * (args.warmup + args.steps + args.profile_steps)
        return OursArm(
            args.model,
            layers,
            args.out / "work" / args.model,
            ep=args.ep,
            dispatcher=args.dispatcher,
            first=first,
            max_steps=max_steps,
            device=device,
            cuda_graphs=name.endswith("-graphs"),
            lora=(args.lora_rank, args.lora_alpha) if name.startswith("moe-sft-lora") else None,
            lora_fp8_base=name.startswith("moe-sft-lora-fp8"),
            static_rows_capacity=args.static_rows_capacity,
            combine_dtype=args.combine_dtype,
            dispatch_chunks=args.dispatch_chunks,
            attention_kernel=args.attention_kernel,
        )
    if name in ("transformers", "transformers-peft"):
        from benchmarks.hf import HFArm

        if args.ep != 1:
            raise SystemExit(f"the {name} arm runs on one GPU: use --ep 1")
        return HFArm(
            hf_config(args.model, layers)[1],
            device=device,
            attn=args.hf_attn,
            experts=args.hf_experts,
            seed=args.seed,
            lora=(args.lora_rank, args.lora_alpha) if name == "transformers-peft" else None,
        )
    if name == "torchtitan":  # experimental: docs/benchmarks.md#torchtitan
        from benchmarks.titan import TitanArm

        return TitanArm(
            hf_config(args.model, layers)[1],
            device=device,
            ep=args.ep,
            seed=args.seed,
            max_seq_len=max(int(b) for b in args.budgets.split(",")),
        )
    raise SystemExit(f"unknown arm {name!r}; choose from {', '.join(ARMS)}")


def run_arm(name: str, args) -> list[dict]:
    """Every budget of one arm in this process; rank 0 merges the records into args.out."""
    import torch

    from benchmarks import results
    from benchmarks.measure import measure
    from benchmarks.workload import PRESETS, Workload, hf_config, model_shape

    device = _device(args.device)
    layers = args.layers or PRESETS[args.model].layers
    vocab = hf_config(args.model, layers)[1].vocab_size
    budgets = [int(b) for b in args.budgets.split(",")]
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def workload(budget):
        micro = max(args.tokens_per_step // budget, world)
        return Workload(budget=budget, micro_batches=micro - micro % world, vocab=vocab, seed=args.seed)

    arm = _make_arm(name, args, device, layers, workload(budgets[0]))
    shape = model_shape(args.model, layers, run_mtp=getattr(arm, "run_mtp", False))
    records = []
    for budget in budgets:
        base = {
            **arm.describe(),
            **dict(arm=name, model=args.model, layers=layers, ep=args.ep, gpus=arm.world, budget=budget, device=device),
        }
        try:
            rec = measure(
                arm, workload(budget), shape, warmup=args.warmup, steps=args.steps, profile_steps=args.profile_steps
            )
        except torch.OutOfMemoryError as err:
            rec = dict(status=f"OOM: {str(err).splitlines()[0][:160]}")
            torch.cuda.empty_cache()
        records.append({**base, **rec})
        if arm.rank == 0:
            r = records[-1]
            print(f"[benchmark] {name} {args.model} L{layers} budget {budget}: {results.run_line(r)}", flush=True)
    if arm.rank == 0:
        results.merge(args.out, runs=records)
    arm.close()
    return records


def cmd_train(args) -> int:
    run_arm(args.arm, args)
    if int(os.environ.get("RANK", "0")) == 0:
        print((args.out / "benchmark.md").read_text())
    return 0


def cmd_compare(args) -> int:
    from benchmarks import results

    arms = [a for a in args.arms.split(",") if a]
    in_process = args.in_process or _device(args.device) == "cpu"
    for name in arms:
        if in_process:
            try:
                run_arm(name, args)
            except Exception as err:  # one broken arm must not lose the other's results
                traceback.print_exc()
                _record_failure(name, args, f"error: {type(err).__name__}: {' '.join(str(err).split())[:300]}")
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "train", "--arm", name, *_forwarded(args)]
        print(f"[benchmark] {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
        if rc:
            _record_failure(name, args, f"failed: exit status {rc} (see the log above)")
    print(results.markdown(results.load(args.out)))
    return 0


def _record_failure(name: str, args, status: str) -> None:
    from benchmarks import results
    from benchmarks.workload import PRESETS

    layers = args.layers or PRESETS[args.model].layers
    done = {results.run_key(r) for r in results.load(args.out)["runs"] if r.get("status") == "ok"}
    runs = [
        dict(arm=name, model=args.model, layers=layers, ep=args.ep, gpus=args.ep, budget=int(b), status=status)
        for b in args.budgets.split(",")
    ]
    results.merge(args.out, runs=[r for r in runs if results.run_key(r) not in done])


def cmd_ceilings(args) -> int:
    from benchmarks import ceilings, results

    for model in args.model.split(","):  # merged per model: a time limit keeps what was measured
        rows = ceilings.run(model, args.budget, _device(args.device), warmup=args.warmup, iters=args.iters)
        results.merge(args.out, ceilings=rows)
    print(results.markdown(results.load(args.out)))
    return 0


def cmd_report(args) -> int:
    from benchmarks import results

    print(results.markdown(results.load(args.dir)))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="one arm in this process (torchrun for EP)")
    train.add_argument("--arm", required=True, choices=ARMS)
    _common(train)
    compare = sub.add_parser("compare", help="several arms side by side, same data, same machine")
    compare.add_argument("--arms", default="moe-sft,transformers", help=f"comma-separated, of {', '.join(ARMS)}")
    compare.add_argument("--in-process", action="store_true", help="no child processes (default on CPU)")
    _common(compare)
    ceil = sub.add_parser("ceilings", help="bf16 matmul, grouped_mm and varlen attention TFLOP/s")
    ceil.add_argument("--model", default="qwen3_30b", help="preset(s) whose shapes to use, comma-separated")
    ceil.add_argument("--budget", type=int, default=8192, help="tokens (rows before top-k) per kernel call")
    ceil.add_argument("--warmup", type=int, default=3)
    ceil.add_argument("--iters", type=int, default=10)
    ceil.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ceil.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "benchmark_out"))
    rep = sub.add_parser("report", help="print DIR/benchmark.json as markdown")
    rep.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    return {"train": cmd_train, "compare": cmd_compare, "ceilings": cmd_ceilings, "report": cmd_report}[args.command](
        args
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
