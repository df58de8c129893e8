"""Export a moe-sft checkpoint (converted or trained, any parallel layout) to an HF directory.

    python tools/export_mcore_to_hf.py --mcore-path CKPT_DIR --output HF_DIR [--dtype bf16|fp32]
                                       [--max-shard-size 5GB]

Writes sharded safetensors + model.safetensors.index.json + config.json + generation_config.json
+ the tokenizer files kept in CKPT_DIR/hf/. Exit status: 0 written; 2 the input is unusable (the
`error:` line names the file/tensor and the fix). The work happens in moe_sft.conversion.export.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

try:
    import moe_sft  # noqa: F401
except ImportError:  # run as `python tools/...` from any cwd without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# transformers' convention (PreTrainedModel.save_pretrained max_shard_size): GB = 10**9, GiB = 2**30.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' → 5_000_000_000, '512MiB' → 536_870_912, '1000' → 1000 bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r}: expected a number with an "
                                         "optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r}: must be positive")
    return size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mcore-path", required=True, help="moe-sft checkpoint directory")
    parser.add_argument("--output", required=True, help="HF directory to write (replaced atomically)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="dtype of the written tensors (default bf16)")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                        help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    parser.add_argument("--traceback", action="store_true",
                        help="show the full traceback instead of the one-line error")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: megatron-core + transformers take ~10 s to import, which
    # `--help` and a mistyped path should not wait for.
    from moe_sft.conversion.export import export

    started = time.time()
    out = export(args.mcore_path, args.output, max_shard_bytes=args.max_shard_size, dtype=args.dtype)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = len(set(index["weight_map"].values()))
    print(f"exported {len(index['weight_map'])} tensors ({args.dtype}, {shards} shard(s), "
          f"{index['metadata']['total_size'] / 1e6:.1f} MB) in {time.time() - started:.1f}s "
          f"-> {out.resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(args.mcore_path).is_dir():
        print(f"error: {args.mcore_path}: moe-sft checkpoint directory does not exist",
              file=sys.stderr)
        return 2
    from moe_sft.errors import run_reporting_user_errors

    return run_reporting_user_errors(run, args)


if __name__ == "__main__":  # required: dist_checkpointing.load may start a multiprocessing manager
    sys.exit(main())
