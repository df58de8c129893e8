"""Export a moe-sft checkpoint (converted or trained, any parallel layout) to an HF directory.

    python tools/export_mcore_to_hf.py --mcore-path CKPT_DIR --output HF_DIR [--dtype bf16|fp32]
                                       [--max-shard-size 5GB] [--read-size 256MiB] [--overwrite]
                                       [--adapter-output ADAPTER_DIR]

A LoRA/DoRA run's checkpoint (it holds the adapters only) is exported merged into its base (read
from the base checkpoint its moe_sft_meta.json names, `peft_base`); --adapter-output also writes
its adapters as a PEFT adapter directory (`PeftModel.from_pretrained(hf_model, ADAPTER_DIR)`), or
fails with the reason when peft cannot express them (moe_sft/peft/hf_adapter.py).

Writes sharded safetensors + model.safetensors.index.json + config.json + generation_config.json
+ the tokenizer files kept in CKPT_DIR/hf/. The export streams: the model is never gathered, each
megatron tensor is read from the checkpoint a run of experts or of rows at a time (at most
--read-size, or one expert/row if larger; a tensor no transform can cut, such as a fused QKV, is
read whole) and each HF tensor is written into its shard as soon as it is made, so memory stays at
the imports (~0.5 GB) plus about one --read-size unit, whatever the model size and the
checkpoint's chunking (docs/conversion_at_scale.md, "Export"). HF_DIR must be absent or empty
(anything else is refused before reading, unless --overwrite) and may not be, contain or lie inside
the checkpoint (refused even with --overwrite); the output is published atomically (written as
HF_DIR.tmp, then renamed). Before writing, the checkpoint's files are checked against megatron's
`.metadata` and the checksums.json its save recorded (a training checkpoint's). Exit status: 0
written; 2 the input is unusable (damaged, truncated) or --output holds something else (the
`error:` line names the file/tensor/directory and the fix); 4 the disk filled up (the partial
export is removed). The work happens in moe_sft.conversion.export.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

try:
    from moe_sft.conversion.sizes import parse_size
except ImportError:  # run as `python tools/...` from any cwd without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from moe_sft.conversion.sizes import parse_size
from moe_sft.conversion.file_io import Progress


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mcore-path", required=True, help="moe-sft checkpoint directory")
    parser.add_argument("--output", required=True, help="HF directory to write: absent or empty, or see --overwrite")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace whatever --output holds (refused otherwise, before exporting)"
    )
    parser.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="bf16", help="dtype of the written tensors (default bf16)"
    )
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=parse_size("5GB"),
        help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default 5GB); "
        "shards are written in place, so this does not change the memory",
    )
    parser.add_argument(
        "--read-size",
        type=parse_size,
        default=parse_size("256MiB"),
        help="most bytes of a megatron tensor read at once (experts, rows); memory is a few of these (default 256MiB)",
    )
    parser.add_argument(
        "--adapter-output",
        default=None,
        help="LoRA/DoRA runs: also write the adapters as a PEFT adapter directory here",
    )
    parser.add_argument(
        "--traceback", action="store_true", help="show the full traceback instead of the one-line error"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: megatron-core + transformers take ~10 s to import, which
    # `--help` and a mistyped path should not wait for.
    from moe_sft.conversion.export import export_with_stats

    started = time.time()
    if args.adapter_output:  # everything the adapter export would refuse, before writing anything
        from moe_sft.peft.hf_adapter import check_adapter_export, export_adapter

        if _nested(Path(args.output), Path(args.adapter_output)):
            print(
                f"error: --adapter-output {args.adapter_output} and --output {args.output} overlap (one would "
                "replace the other); pick two separate directories",
                file=sys.stderr,
            )
            return 2
        check_adapter_export(args.mcore_path, args.adapter_output, overwrite=args.overwrite)
    out, stats = export_with_stats(
        args.mcore_path,
        args.output,
        max_shard_bytes=args.max_shard_size,
        dtype=args.dtype,
        read_bytes=args.read_size,
        progress=Progress("written"),
        overwrite=args.overwrite,
    )
    if args.adapter_output:
        adapter = export_adapter(args.mcore_path, args.adapter_output, dtype=args.dtype, overwrite=args.overwrite)
        print(f"exported PEFT adapter -> {adapter.resolve()}")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = len(set(index["weight_map"].values()))
    print(
        f"exported {len(index['weight_map'])} tensors ({args.dtype}, {shards} shard(s), "
        f"{index['metadata']['total_size'] / 1e6:.1f} MB) in {time.time() - started:.1f}s "
        f"({stats.written_bytes / 1e6 / max(stats.seconds, 1e-9):.0f} MB/s) -> {out.resolve()}"
    )
    return 0


def _nested(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(args.mcore_path).is_dir():
        print(f"error: {args.mcore_path}: moe-sft checkpoint directory does not exist", file=sys.stderr)
        return 2
    from moe_sft.errors import run_reporting_user_errors

    return run_reporting_user_errors(run, args)


if __name__ == "__main__":  # required: dist_checkpointing.load may start a multiprocessing manager
    sys.exit(main())
