"""Convert an HF checkpoint into a moe-sft (megatron-core dist checkpoint) directory.

    python tools/convert_hf_to_mcore.py --hf-path HF_DIR --output MCORE_DIR [--verify] [--tolerance 1e-3]

Exit status: 0 converted (and, with --verify, logits within tolerance); 1 --verify found a logit
difference above --tolerance; 2 the input is unusable (the `error:` line names the file/tensor/field).
The work happens in moe_sft.conversion.convert; this file only parses arguments and reports.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    import moe_sft  # noqa: F401
except ImportError:  # run as `python tools/...` from any cwd without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-path", required=True, help="directory with config.json and *.safetensors")
    parser.add_argument("--output", required=True, help="moe-sft checkpoint directory to write")
    parser.add_argument("--verify", action="store_true",
                        help="compare logits with transformers' model (fp32, CPU) after converting")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="max abs logit difference accepted by --verify (default 1e-3)")
    parser.add_argument("--traceback", action="store_true",
                        help="show the full traceback instead of the one-line error")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: megatron-core + transformers take ~10 s to import, which
    # `--help` and a mistyped path should not wait for.
    from moe_sft.conversion.convert import convert, verify

    started = time.time()
    meta = convert(args.hf_path, args.output)
    status = 0
    if args.verify:
        diff = verify(args.hf_path, args.output, tolerance=args.tolerance)
        print(f"max abs logit difference: {diff:.3e} (tolerance {args.tolerance:g})")
        if diff > args.tolerance:
            print(f"error: {args.output}: logits differ from transformers' {meta['model_type']} by "
                  f"{diff:.3e} > {args.tolerance:g}; the conversion is wrong for this model",
                  file=sys.stderr)
            status = 1
    print(f"converted {meta['hf_tensors']} HF tensors ({meta['family']}, {meta['params_dtype']}) "
          f"in {time.time() - started:.1f}s -> {Path(args.output).resolve()}")
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(args.hf_path).is_dir():
        print(f"error: {args.hf_path}: HF checkpoint directory does not exist", file=sys.stderr)
        return 2
    from moe_sft.errors import run_reporting_user_errors

    return run_reporting_user_errors(run, args)


if __name__ == "__main__":  # required: dist_checkpointing.save starts a multiprocessing manager
    sys.exit(main())
