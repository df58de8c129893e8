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


def copy_hf_side_files(src: Path, dst: Path, config_changes: dict | None = None) -> list[str]:
    """config, generation config and tokenizer files: training and export need nothing else.

    `config_changes` ({field: value}) are written into the copied config.json, the one every later
    reader (trainer, export, planner) takes the model from; the other fields are kept as they are.
    """
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)
            copied.append(name)
    if config_changes and "config.json" in copied:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_changes)
        (dst / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
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


def checkpoint_problems(ckpt_dir: str | Path, field: str = "model.mcore_path") -> list[str]:
    """What makes `ckpt_dir` unusable as a moe-sft checkpoint, one message per problem (no I/O
    beyond listing and small JSON files: safe before any GPU work). [] when it looks complete.

    Complete means: megatron's torch_dist files (`.metadata`, `metadata.json`, `*.distcp`), our
    `moe_sft_meta.json` (written last, so a crash mid-write leaves none) and `hf/config.json`
    agreeing with the meta.
    """
    path = Path(ckpt_dir)
    where = f"{field}={str(ckpt_dir)!r}"
    staging = path.with_name(path.name + ".tmp")
    if not path.is_dir():
        if staging.is_dir():
            return [f"{where} does not exist but {staging} does: a conversion or save into it was "
                    f"interrupted; rerun tools/convert_hf_to_mcore.py (it replaces the .tmp dir)"]
        return []  # a missing path is reported by the config validation, with its fix
    problems = []
    missing = [n for n in (".metadata", "metadata.json") if not (path / n).is_file()]
    if not any(path.glob("*.distcp")):
        missing.append("*.distcp")
    meta_file = path / META_FILE
    if not meta_file.is_file():
        what = ("a megatron checkpoint without moe-sft's meta (not written by moe-sft, or its write was "
                "interrupted)" if not missing else "not a moe-sft checkpoint")
        return [f"{where} is {what}: no {META_FILE}; convert with tools/convert_hf_to_mcore.py"]
    if missing:
        problems.append(f"{where} is partial or corrupt: {', '.join(missing)} missing (megatron dist-checkpoint "
                        f"files); reconvert, or resume from an older checkpoint")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return problems + [f"{where}: {META_FILE} is not valid JSON ({err}); the checkpoint is corrupt, reconvert it"]
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        problems.append(f"{where} was written by a newer moe-sft (format_version={meta.get('format_version')}, "
                        f"this one reads {FORMAT_VERSION}); update moe-sft")
    hf_config = path / HF_SUBDIR / "config.json"
    if not hf_config.is_file():
        return problems + [f"{where}: {HF_SUBDIR}/config.json is missing (training and export read it); reconvert"]
    try:
        hf = json.loads(hf_config.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return problems + [f"{where}: {HF_SUBDIR}/config.json is not valid JSON ({err}); reconvert"]
    for key, hf_key in (("model_type", "model_type"), ("vocab_size", "vocab_size")):
        if key in meta and meta[key] != hf.get(hf_key):
            problems.append(f"{where}: {META_FILE} says {key}={meta[key]!r} but {HF_SUBDIR}/config.json says "
                            f"{hf.get(hf_key)!r}; the directory mixes two models, reconvert it")
    return problems
