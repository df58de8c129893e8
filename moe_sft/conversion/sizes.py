"""Byte sizes on the command line ('5GB', '256MiB', '4096'), for the conversion and export tools.

transformers' convention (PreTrainedModel.save_pretrained max_shard_size): GB = 10**9, GiB = 2**30.
"""

from __future__ import annotations

import argparse
import re

UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class SizeError(argparse.ArgumentTypeError, ValueError):
    """Not a positive size; as an argparse `type=` error, argparse prefixes the option's name."""


def parse_size(text: str) -> int:
    """'5GB' → 5_000_000_000, '512MiB' → 536_870_912, '1000' → 1000 bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    size = int(float(match.group(1)) * UNITS[unit]) if unit in UNITS else 0
    if size <= 0:
        raise SizeError(
            f"{text!r}: expected a positive number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return size
