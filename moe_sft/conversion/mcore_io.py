"""The moe-sft checkpoint directory: a megatron dist checkpoint plus what training/export need.

Layout of a converted (or trained) checkpoint directory:

    <dir>/                      torch_dist files written by megatron.core.dist_checkpointing
    <dir>/moe_sft_meta.json     family, vocab sizes, what wrote it
    <dir>/hf/                   config.json, generation_config.json, tokenizer files (copied)

Directories are written to `<dir>.tmp` and renamed, so a crash never leaves a half checkpoint; a
conversion that fails removes its `<dir>.tmp` (with the files of all its worker processes).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

META_FILE = "moe_sft_meta.json"
HF_SUBDIR = "hf"
FORMAT_VERSION = 1
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
                 "chat_template.jinja", "chat_template.json", "added_tokens.json")


def write_meta(ckpt_dir: Path, meta: dict) -> None:
    meta = dict(meta, format_version=FORMAT_VERSION)
    (Path(ckpt_dir) / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))


def read_meta(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir}: no {META_FILE}; this is not a moe-sft checkpoint. "
                                "Make one with tools/convert_hf_to_mcore.py.")
    return json.loads(path.read_text())


def copy_hf_side_files(src: Path, dst: Path) -> list[str]:
    """config, generation config and tokenizer files: training and export need nothing else."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)
            copied.append(name)
    return copied


def staging_dir(final: Path) -> Path:
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def discard_staging(tmp: Path) -> None:
    """A failed write leaves nothing behind (the previous `final`, if any, is untouched)."""
    shutil.rmtree(tmp, ignore_errors=True)


def commit_dir(tmp: Path, final: Path) -> None:
    """Atomically publish `tmp` as `final` (replacing an older one)."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
