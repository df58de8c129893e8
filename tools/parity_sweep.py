"""Parity with transformers over random legal configs of each family (moe_sft/conversion/parity.py).

    python tools/parity_sweep.py --configs 200 [--families qwen3_moe,mixtral,deepseek_v3]
        [--first-seed 0] [--out results.jsonl] [--keep-failures DIR]

Each config is drawn from the family's `sample_hf_config` with its seed, built with transformers,
perturbed, saved in bf16, converted, and checked: fp32 logits within 1e-4 of transformers', a
bit-exact export, an export transformers loads. --configs is the total, split evenly over the
families. One line per config; exit status 1 if any config failed (its HF checkpoint is kept in
--keep-failures to reproduce it). CI runs a fixed-seed sample (tests/cpu/test_config_space.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

try:
    from moe_sft.conversion import parity
except ImportError:  # run as `python tools/...` without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from moe_sft.conversion import parity
from moe_sft.models import registry


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=int, default=200, help="configs in all (default 200)")
    parser.add_argument("--families", default="qwen3_moe,mixtral,deepseek_v3")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write one JSON line per config here")
    parser.add_argument("--keep-failures", type=Path, help="copy failing HF checkpoints here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per config, not per save and load
    families = [registry.family_by_name(name) for name in args.families.split(",")]
    per_family = -(-args.configs // len(families))
    seeds = range(args.first_seed, args.first_seed + per_family)
    out = args.out.open("w") if args.out else None
    started, failed, total, worst = time.time(), 0, 0, {}
    for family in families:
        for result in parity.sweep(family, seeds, args.keep_failures):
            total += 1
            failed += not result.passed
            worst[family.name] = max(worst.get(family.name, 0.0), result.max_logit_diff)
            status = "ok  " if result.passed else "FAIL"
            print(
                f"{status} {family.name} seed {result.seed}: max abs logit diff "
                f"{result.max_logit_diff:.2e} round trip {'exact' if result.round_trip_exact else 'DIFFERS'}"
                f"{' ' + result.error if result.error else ''}",
                flush=True,
            )
            if out:
                out.write(parity.result_json(result) + "\n")
                out.flush()
    summary = ", ".join(f"{name} worst {diff:.2e}" for name, diff in worst.items())
    print(f"{total - failed} passed, {failed} failed ({summary}; {time.time() - started:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":  # required: dist_checkpointing.save starts a multiprocessing manager
    sys.exit(main())
