"""The moe-sft checkpoint directory: a megatron dist checkpoint plus what training/export need.

Layout of a converted (or trained) checkpoint directory:

    <dir>/                      torch_dist files written by megatron.core.dist_checkpointing
    <dir>/moe_sft_meta.json     family, vocab sizes, what wrote it
    <dir>/hf/                   config.json, generation_config.json, tokenizer files (copied)
    <dir>/hf/carried/           a multimodal source's tensors outside the language model (its vision
                                tower), carried through untrained for the export (composite.py)

Directories are written to `<dir>.tmp` and renamed, so a crash never leaves a half checkpoint; a
conversion that fails removes its `<dir>.tmp` (with the files of all its worker processes).
Conversion and export never replace a directory they did not write: `check_output` refuses a
non-empty `--output` (and a `<dir>.tmp` without a moe-sft staging stamp) unless told to overwrite.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from moe_sft.conversion.hf_reader import CheckpointError

META_FILE = "moe_sft_meta.json"
HF_SUBDIR = "hf"
FORMAT_VERSION = 1
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "tiktoken.model",  # Kimi-K2's tokenizer (tokenization_kimi.py, named by tokenizer_config's auto_map)
    # a vision-language release's processors (Qwen3.5): the export is that model again
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
CARRIED_DIR = "carried"  # in HF_SUBDIR: composite.py
# Stamps in a staging dir `<out>.tmp` (removed before it is renamed): an interrupted conversion's
# (first line: its run id, second: the HF source) and an interrupted export's (the checkpoint).
CONVERT_STAMP = ".moe_sft_run"
EXPORT_STAMP = ".moe_sft_export"
STEP_DIR = re.compile(r"step_(\d+)")  # the trainer's checkpoints/step_0000010
# Meta key: the HF copies (of the embedding / LM head, in MTP layers) the source did not store
# (mapping.without_copies); the export leaves them out too.
COPIES_ABSENT = "hf_copies_absent"


class OutputDirError(CheckpointError):
    """--output holds something this run did not write (exit 2: pick another or --overwrite)."""


def base_identity(mcore_path: Path) -> str:
    """A fingerprint of a converted base: its meta file (source, conversion, HF config)."""
    return hashlib.sha256((Path(mcore_path) / META_FILE).read_bytes()).hexdigest()[:16]


def write_meta(ckpt_dir: Path, meta: dict) -> None:
    meta = dict(meta, format_version=FORMAT_VERSION)
    (Path(ckpt_dir) / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))


def read_meta(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(_not_a_checkpoint(Path(ckpt_dir)))
    return json.loads(path.read_text())


def latest_complete_step(root: Path) -> Path | None:
    """The `step_N` dir in `root` with the largest N that was committed (holds the meta)."""
    steps = (
        [
            (int(m[1]), p)
            for p in Path(root).iterdir()
            if (m := STEP_DIR.fullmatch(p.name)) and (p / META_FILE).is_file()
        ]
        if Path(root).is_dir()
        else []
    )
    return max(steps)[1] if steps else None


def _not_a_checkpoint(ckpt: Path) -> str:
    """Why `ckpt` (no meta) cannot be read, and what to read instead: an interrupted save's
    `step_N.tmp` names the latest complete step next to it."""
    if not ckpt.name.endswith(".tmp"):
        return f"{ckpt}: no {META_FILE}; this is not a moe-sft checkpoint. Make one with tools/convert_hf_to_mcore.py."
    final = ckpt.with_name(ckpt.name[: -len(".tmp")])
    step = STEP_DIR.fullmatch(final.name)
    if step:
        latest = latest_complete_step(ckpt.parent)
        done = (
            f"export {latest} (the latest complete step)"
            if latest
            else f"no complete step_N checkpoint is next to it in {ckpt.parent}; resume the training to save one"
        )
        return f"{ckpt}: an interrupted save (step {int(step[1])} was not committed); {done}"
    if (final / META_FILE).is_file():
        return f"{ckpt}: an interrupted write into {final} (not committed); use {final}, the complete checkpoint"
    return (
        f"{ckpt}: an interrupted conversion or save (never committed); rerun "
        f"tools/convert_hf_to_mcore.py --output {final}"
    )


def copy_hf_side_files(
    src: Path, dst: Path, config_changes: dict | None = None, with_carried: bool = True
) -> list[str]:
    """config, generation config and tokenizer files: training and export need nothing else.

    `config_changes` ({field: value}) are written into the copied config.json, the one every later
    reader (trainer, export, planner) takes the model from; the other fields are kept as they are.
    `with_carried`: also the tensors carried through (`CARRIED_DIR`, hard-linked where the
    filesystem allows: they are never written in place); the export writes them into its shards.
    """
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)
            copied.append(name)
    for name in remote_code_files(Path(src)):
        shutil.copy2(Path(src) / name, dst / name)
        copied.append(name)
    if with_carried and (Path(src) / CARRIED_DIR).is_dir():
        shutil.rmtree(dst / CARRIED_DIR, ignore_errors=True)
        shutil.copytree(Path(src) / CARRIED_DIR, dst / CARRIED_DIR, copy_function=_link_or_copy)
        copied.append(CARRIED_DIR)
    if config_changes and "config.json" in copied:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_changes)
        (dst / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return copied


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def remote_code_files(src: Path) -> list[str]:
    """The modules (`<module>.py` in `src`) that config.json's and tokenizer_config.json's
    `auto_map` name, e.g. Kimi-K2's configuration_deepseek.py: a checkpoint keeps them, so that
    `trust_remote_code` loads it as it loads the release. An entry naming another repository
    (`org/repo--module.Class`) has no file here, nor has a module the source itself lacks."""
    modules = set()
    for name in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((src / name).read_text()).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue  # absent or not an object: the readers of that file say so
        for ref in auto_map.values():
            for entry in ref if isinstance(ref, list) else [ref]:  # tokenizers: [slow, fast]
                if isinstance(entry, str) and "--" not in entry and entry.count(".") == 1:
                    modules.add(entry.split(".")[0] + ".py")
    return sorted(m for m in modules if (src / m).is_file())


def staging_dir(final: Path) -> Path:
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def discard_staging(tmp: Path) -> None:
    """A failed write leaves nothing behind (the previous `final`, if any, is untouched)."""
    shutil.rmtree(tmp, ignore_errors=True)


def commit_dir(tmp: Path, final: Path) -> None:
    """Atomically publish `tmp` as `final` (replacing an older one: conversion and export check
    with `check_output` first that it is theirs to replace)."""
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")  # never someone's `<final>.old`
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def staging_stamp(tmp: Path) -> str | None:
    """What an interrupted moe-sft write left in the staging dir `tmp`, in words; None when `tmp`
    holds no stamp of ours."""
    convert, export = Path(tmp) / CONVERT_STAMP, Path(tmp) / EXPORT_STAMP
    try:
        if convert.is_file():
            run, _, source = convert.read_text().partition("\n")
            return f"an interrupted conversion{f' of {source}' if source else ''} (run {run!r})"
        if export.is_file():
            source = export.read_text().strip()
            return f"an interrupted export{f' of {source}' if source else ''}"
    except OSError:
        return None
    return None


def describe_dir(path: Path, limit: int = 5) -> str:
    """What a directory holds, in a few words: a moe-sft checkpoint (of which source), an HF model
    or its first entries and file count."""
    path = Path(path)
    meta = path / META_FILE
    if meta.is_file():
        try:
            m = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            m = {}
        step = f", step {m['step']}" if m.get("step") else ""
        return f"a moe-sft checkpoint of {m.get('source', 'an unknown source')} ({m.get('model_type', '?')}{step})"
    stamp = staging_stamp(path)
    if stamp:
        return stamp
    shards = sorted(path.glob("*.safetensors"))
    if (path / "config.json").is_file() and shards:
        try:
            model_type = json.loads((path / "config.json").read_text()).get("model_type", "?")
        except (OSError, json.JSONDecodeError, AttributeError):
            model_type = "?"
        return f"an HF model ({model_type}, {len(shards)} safetensors file(s))"
    count = 0
    for count, _ in enumerate((p for p in path.rglob("*") if p.is_file()), 1):
        if count > 999:
            break
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")
    files = "1000+ files" if count > 999 else f"{count} file{'' if count == 1 else 's'}"
    return f"{files}: {shown}"


def _non_empty(path: Path) -> bool:
    return path.is_dir() and next(path.iterdir(), None) is not None


def check_output(out: str | Path, overwrite: bool = False, accept: Callable[[Path], bool] | None = None) -> str | None:
    """Refuse (OutputDirError) an output this run would destroy without having written it: a
    non-empty `out` (unless `overwrite`, or `accept(out)` says it is this job's own), a file, or a
    non-empty `<out>.tmp` without a moe-sft staging stamp. Cheap (listing, small JSON): call it
    before any heavy work. Returns what an interrupted earlier write left in `<out>.tmp` (which
    the writer then replaces), in words, or None.
    """
    out = Path(out)
    fix = "pass --overwrite (overwrite=True) to replace it, or pick another --output"
    tmp = out.with_name(out.name + ".tmp")
    for path in (out, tmp):
        if path.exists() and not path.is_dir():
            raise OutputDirError(f"{path} is a file, not a directory; remove it or pick another --output")
    if _non_empty(out) and not overwrite and not (accept and accept(out)):
        raise OutputDirError(f"--output {out} is not empty: it holds {describe_dir(out)}; {fix}")
    if not _non_empty(tmp):
        return None
    stamp = staging_stamp(tmp)
    if stamp is None and not overwrite:
        raise OutputDirError(
            f"{tmp} (where --output {out} is staged) holds {describe_dir(tmp)}, not an interrupted moe-sft write; {fix}"
        )
    return stamp or "a directory that --overwrite replaces"


def check_not_a_source(out: str | Path, sources: dict[str, Path]) -> None:
    """Refuse (OutputDirError) an `out` that is, contains or lies inside a checkpoint the job
    reads (`sources`: {what: path}), `<out>.tmp` too: writing it replaces it whole, so
    `--overwrite` would delete the checkpoint being read. Call before touching anything."""
    out = Path(out)
    for path in (out, out.with_name(out.name + ".tmp")):
        target = path.resolve()
        for what, source in sources.items():
            src = Path(source).resolve()
            how = (
                "is"
                if target == src
                else "contains"
                if target in src.parents
                else "lies inside"
                if src in target.parents
                else None
            )
            if how:
                raise OutputDirError(
                    f"--output {out} {how} {what} {source}"
                    + (f" (through {path})" if path != out else "")
                    + f": the export replaces --output whole, so it would delete or change the checkpoint it reads; "
                    f"pick an --output outside {source}"
                )


_EXPORT_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
EXPORT_INDEX = "model.safetensors.index.json"


def written_by_export(out: Path) -> Callable[[str], bool]:
    """Whether a file name in the HF export directory `out` is one an export writes: the side
    files, the safetensors shards and their index, and the remote-code modules its `auto_map`s
    name."""
    modules = set(remote_code_files(Path(out))) if Path(out).is_dir() else set()
    return lambda name: (
        name in HF_SIDE_FILES or name in modules or name == EXPORT_INDEX or _EXPORT_SHARD.fullmatch(name) is not None
    )


def user_entries(out: Path, ours: Callable[[str], bool]) -> list[str]:
    """What `out` holds that no export writes (a user's files and directories), sorted."""
    if not Path(out).is_dir():
        return []
    return sorted(p.name + "/" if p.is_dir() else p.name for p in Path(out).iterdir() if p.is_dir() or not ours(p.name))


def user_entries_message(out: Path, theirs: list[str], what: str) -> str:
    shown = ", ".join(theirs[:5]) + (" ..." if len(theirs) > 5 else "")
    return (
        f"{out} is this run's {what} (trainer.export_hf_at_end) but also holds {shown}, which no export "
        f"writes: the export replaces {out} whole and would delete them. Move them out of {out} and export "
        "again (the training command exports a finished run), or set trainer.export_hf_at_end=false"
    )


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
            return [
                f"{where} does not exist but {staging} does: a conversion or save into it was "
                f"interrupted; rerun tools/convert_hf_to_mcore.py (it replaces the .tmp dir)"
            ]
        return []  # a missing path is reported by the config validation, with its fix
    problems = []
    missing = [n for n in (".metadata", "metadata.json") if not (path / n).is_file()]
    if not any(path.glob("*.distcp")):
        missing.append("*.distcp")
    meta_file = path / META_FILE
    if not meta_file.is_file():
        what = (
            "a megatron checkpoint without moe-sft's meta (not written by moe-sft, or its write was interrupted)"
            if not missing
            else "not a moe-sft checkpoint"
        )
        return [f"{where} is {what}: no {META_FILE}; convert with tools/convert_hf_to_mcore.py"]
    if missing:
        problems.append(
            f"{where} is partial or corrupt: {', '.join(missing)} missing (megatron dist-checkpoint "
            f"files); reconvert, or resume from an older checkpoint"
        )
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return problems + [f"{where}: {META_FILE} is not valid JSON ({err}); the checkpoint is corrupt, reconvert it"]
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        problems.append(
            f"{where} was written by a newer moe-sft (format_version={meta.get('format_version')}, "
            f"this one reads {FORMAT_VERSION}); update moe-sft"
        )
    hf_config = path / HF_SUBDIR / "config.json"
    if not hf_config.is_file():
        return problems + [f"{where}: {HF_SUBDIR}/config.json is missing (training and export read it); reconvert"]
    try:
        hf = json.loads(hf_config.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return problems + [f"{where}: {HF_SUBDIR}/config.json is not valid JSON ({err}); reconvert"]
    # a multimodal config.json holds the language model's fields in its text_config
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    for key, found in (("model_type", hf.get("model_type")), ("vocab_size", text.get("vocab_size"))):
        if key in meta and meta[key] != found:
            problems.append(
                f"{where}: {META_FILE} says {key}={meta[key]!r} but {HF_SUBDIR}/config.json says "
                f"{found!r}; the directory mixes two models, reconvert it"
            )
    return problems
