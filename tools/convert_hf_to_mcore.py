"""Convert an HF checkpoint into a moe-sft (megatron-core dist checkpoint) directory.

    python tools/convert_hf_to_mcore.py --hf-path HF_DIR --output MCORE_DIR [--overwrite] [--workers N]
        [--chunk-size 256MiB] [--verify] [--verify-layers [auto|all|0,3,61]] [--tolerance 1e-4]
        [--nodes M --node-rank R --run-id ID]   # one launch per node, e.g. under srun

The conversion streams: the megatron model exists only on the meta device and every tensor chunk
is made from the HF tensors it needs just before it is written, so memory stays at about the
imports (~0.5 GB) plus a few chunks, whatever the model size (docs/conversion_at_scale.md).
--workers N writes with N processes, each its own share of the chunks; --nodes M spreads the
work over M nodes (N processes each) writing into the same directory on shared storage: launch
this command once per node with its --node-rank; node 0 publishes the checkpoint when all are done.

--output must be absent or empty: anything else (another model's checkpoint, your files) is
refused before converting unless --overwrite is given; a `MCORE_DIR.tmp` left by an interrupted
conversion is replaced (reused when --run-id is the same), and the tool says which.

--verify compares logits with transformers' whole model (both whole models in memory: small models);
--verify-layers compares a few decoder layers one at a time with transformers' decoder-layer
module, loading only those layers' tensors, so it runs at any model size (a line per layer).

Exit status: 0 converted (and verified within tolerance); 1 --verify found a logit difference, or
--verify-layers a layer difference, above --tolerance; 2 the input is unusable, or --output holds
something else (the `error:` line names the file/tensor/field/directory).
The work happens in moe_sft.conversion.convert; this file only parses arguments and reports.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

try:
    from moe_sft.conversion.sizes import parse_size
except ImportError:  # run as `python tools/...` from any cwd without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from moe_sft.conversion.sizes import parse_size
from moe_sft.conversion.file_io import Progress


def _slurm_attempt() -> str | None:
    job = os.environ.get("SLURM_JOB_ID")
    return f"{job}.{os.environ.get('SLURM_RESTART_COUNT', 0)}" if job else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-path", required=True, help="directory with config.json and *.safetensors")
    parser.add_argument(
        "--output", required=True, help="moe-sft checkpoint directory to write: absent or empty, or see --overwrite"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace whatever --output holds (refused otherwise, before converting)",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="processes writing disjoint shares of the checkpoint (default 1)"
    )
    parser.add_argument(
        "--chunk-size",
        type=parse_size,
        default="256MiB",
        help="largest tensor chunk written at once; memory is a few of these (default 256MiB)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=int(os.environ.get("SLURM_NNODES", 1)),
        help="nodes sharing the conversion (default $SLURM_NNODES or 1)",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=int(os.environ.get("SLURM_NODEID", 0)),
        help="this node's rank in [0, nodes) (default $SLURM_NODEID or 0)",
    )
    parser.add_argument(
        "--run-id",
        default=_slurm_attempt(),
        help="the same on every node and new for every attempt (default "
        "$SLURM_JOB_ID.$SLURM_RESTART_COUNT); required with --nodes > 1",
    )
    parser.add_argument(
        "--node-timeout", type=float, default=24 * 3600, help="seconds node 0 waits for the other nodes (default 86400)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="compare logits with transformers' model (fp32, CPU) after converting; "
        "unlike the conversion this loads both whole models into memory",
    )
    parser.add_argument(
        "--verify-layers",
        nargs="?",
        const="auto",
        metavar="auto|all|I,J,...",
        help="compare decoder layers one at a time with transformers' decoder-layer "
        "module (fp32, CPU), loading only their tensors: any model size. auto "
        "(the default when given without a value): the first dense, first MoE "
        "and last layer, and the first MTP layer; MTP layer k is "
        "num_hidden_layers + k (e.g. 61 for DeepSeek-V3)",
    )
    parser.add_argument(
        "--verify-tokens",
        type=int,
        default=128,
        help="random tokens (3 packed documents) each layer runs on with "
        "--verify-layers (default 128); more tokens reach more experts",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="--verify: max abs logit difference; --verify-layers: max abs difference "
        "relative to the largest |layer output - input| (default 1e-4 for both)",
    )
    parser.add_argument(
        "--traceback", action="store_true", help="show the full traceback instead of the one-line error"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: megatron-core + transformers take ~10 s to import, which
    # `--help` and a mistyped path should not wait for.
    from moe_sft.conversion.convert import convert
    from moe_sft.conversion.verify import verify

    bad = _check_layer_choice(args)  # before a conversion that may take hours
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    started = time.time()
    meta = convert(
        args.hf_path,
        args.output,
        workers=args.workers,
        max_chunk_bytes=args.chunk_size,
        progress=Progress("of this process's share"),
        nodes=args.nodes,
        node_rank=args.node_rank,
        run_id=args.run_id or "local",
        node_timeout_s=args.node_timeout,
        overwrite=args.overwrite,
    )
    size = meta["written_bytes"]
    size = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
    whose = f"node {args.node_rank}'s share: " if args.nodes > 1 and args.node_rank else ""
    print(
        f"{whose}wrote {size} of tensors in {meta['seconds']:.1f}s "
        f"({meta['written_bytes'] / 1e6 / max(meta['seconds'], 1e-9):.0f} MB/s, "
        f"{args.workers} worker process(es) per node, {args.nodes} node(s))"
    )
    if args.node_rank > 0:
        return 0  # node 0 publishes (and verifies) the checkpoint
    status = 0
    if args.verify:
        print("verifying: loads transformers' model and the converted one whole (fp32) into memory", file=sys.stderr)
        diff = verify(args.hf_path, args.output, tolerance=args.tolerance)
        print(f"max abs logit difference: {diff:.3e} (tolerance {args.tolerance:g})")
        if not diff <= args.tolerance:  # NaN fails too
            print(
                f"error: {args.output}: logits differ from transformers' {meta['model_type']} by "
                f"{diff:.3e} > {args.tolerance:g}; the conversion is wrong for this model",
                file=sys.stderr,
            )
            status = 1
    if args.verify_layers and _verify_layers(args, meta["model_type"]):
        status = 1
    print(
        f"converted {meta['hf_tensors']} HF tensors ({meta['family']}, {meta['params_dtype']}) "
        f"in {time.time() - started:.1f}s -> {Path(args.output).resolve()}"
    )
    return status


def _check_layer_choice(args: argparse.Namespace) -> str | None:
    """An unusable --verify-layers value, said before converting (the HF config decides the range)."""
    if not args.verify_layers:
        return None
    from moe_sft.conversion.hf_source import load_hf_config
    from moe_sft.conversion.verify import choose_layers

    family, hf_cfg = load_hf_config(Path(args.hf_path), check_supported=False)
    try:
        choose_layers(family, hf_cfg, args.verify_layers)
    except ValueError as err:
        return str(err)
    return None


def _verify_layers(args: argparse.Namespace, model_type: str) -> bool:
    """Print a line per compared layer; True when a layer is beyond --tolerance."""
    from moe_sft.conversion.verify import verify_layers

    print(
        "verifying layers one at a time against transformers' decoder layers (fp32): memory is "
        "a few times the largest chosen layer, not the model",
        file=sys.stderr,
    )
    results = verify_layers(
        args.hf_path,
        args.output,
        args.verify_layers,
        tokens=args.verify_tokens,
        on_result=lambda r: print(r.line(args.tolerance), flush=True),
    )
    failed = [r.layer for r in results if not r.passed(args.tolerance)]
    if failed:
        print(
            f"error: {args.output}: layer(s) {', '.join(map(str, failed))} differ from transformers' "
            f"{model_type} by more than {args.tolerance:g} of the layer's output scale; the "
            "conversion is wrong for them (the mapping rule or transform of a tensor in them)",
            file=sys.stderr,
        )
    return bool(failed)


def _check_layout(args: argparse.Namespace) -> str | None:
    if args.workers < 1:
        return f"--workers {args.workers}: use 1 or more processes"
    if args.nodes < 1 or not 0 <= args.node_rank < args.nodes:
        return f"--nodes {args.nodes} --node-rank {args.node_rank}: the rank must be in [0, nodes)"
    if args.verify_tokens < 16:
        return f"--verify-tokens {args.verify_tokens}: use 16 or more tokens"
    if args.nodes > 1 and not args.run_id:
        return (
            "--nodes > 1 needs --run-id: a value shared by all nodes of this attempt and new "
            "for the next (under slurm it defaults to $SLURM_JOB_ID.$SLURM_RESTART_COUNT)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bad = _check_layout(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    if not Path(args.hf_path).is_dir():
        print(f"error: {args.hf_path}: HF checkpoint directory does not exist", file=sys.stderr)
        return 2
    from moe_sft.errors import run_reporting_user_errors

    return run_reporting_user_errors(run, args)


if __name__ == "__main__":  # required: dist_checkpointing.save starts a multiprocessing manager
    sys.exit(main())
