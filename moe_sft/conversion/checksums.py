"""Is a torch_dist checkpoint directory whole and unchanged since its save? Pure file checks, no
torch.distributed: the trainer's resume (moe_sft/trainer/checkpoint_integrity.py spreads them over
the ranks) and the export (`verify_files`, one process) both run them before reading a tensor.

* `storage_problems`: megatron's files are there and every storage file reaches the last byte
  `.metadata` puts in it (truncation, a missing rank's file, a garbled `.metadata`).
* `checksum_problems`: every file against the size and CRC-32 the save recorded in
  `checksums.json` (one flipped byte).

CRC-32 (zlib, streamed in 8 MiB chunks, GIL released: docs/log.md for its speed) detects every
corruption of up to 32 bits and any other with probability 1 - 2^-32: corruption, not tampering.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moe_sft.conversion import mcore_io
from moe_sft.conversion.hf_reader import CheckpointError
from moe_sft.runtime.logs import get_logger

CHECKSUM_FILE = "checksums.json"
CHUNK = 8 << 20
STEP_DIR = re.compile(r"step_(\d{7})$")  # = trainer/checkpoint.step_dir's names
log = get_logger(__name__)


class DamagedCheckpointError(CheckpointError):
    """A checkpoint to export is truncated or changed since its save; the message names the file."""


def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def hash_files(paths: list[Path], root: Path | None = None) -> dict[str, dict]:
    """{file name (its path under `root`, e.g. hf/config.json): {size, crc32}}, up to 4 files hashed at once."""

    def one(p: Path) -> tuple[str, dict]:
        return str(p.relative_to(root)) if root else p.name, {"size": p.stat().st_size, "crc32": file_crc32(p)}

    if len(paths) <= 1:
        return dict(map(one, paths))
    with ThreadPoolExecutor(max_workers=min(4, len(paths))) as pool:  # zlib releases the GIL
        return dict(pool.map(one, paths))


def read_checksums(ckpt_dir: Path) -> dict | None:
    """{file: {size, crc32}}, or None when the checkpoint has none (written before checksums)."""
    path = Path(ckpt_dir) / CHECKSUM_FILE
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if doc.get("algorithm") != "crc32" or not isinstance(doc.get("files"), dict):
        raise ValueError(f"unknown layout (algorithm={doc.get('algorithm')!r})")
    return doc["files"]


def checksum_problems(ckpt_dir: Path, sums: dict, names: list[str]) -> dict[str, str]:
    """{file: problem} for the files `names` against their recorded size and CRC-32."""
    problems = {}
    for name in names:
        path, want = Path(ckpt_dir) / name, sums[name]
        if not path.is_file():
            problems[name] = "missing"
        elif path.stat().st_size != want["size"]:
            problems[name] = f"{path.stat().st_size} bytes, {want['size']} when saved"
    rest = [n for n in names if n not in problems]
    for name, entry in hash_files([Path(ckpt_dir) / n for n in rest], root=Path(ckpt_dir)).items():
        if entry["crc32"] != sums[name]["crc32"]:
            problems[name] = (
                f"contents changed since the save (CRC-32 {entry['crc32']}, {sums[name]['crc32']} when saved)"
            )
    return problems


def storage_problems(ckpt_dir: Path) -> dict[str, str]:
    """{file: problem} of a torch_dist checkpoint's megatron files, without torch.distributed:
    metadata.json parses, common.pt exists, `.metadata` unpickles and every storage file it lists
    exists and reaches the end of the last byte range `.metadata` puts in it."""
    path = Path(ckpt_dir)
    problems = {}
    try:
        backend = json.loads((path / "metadata.json").read_text()).get("sharded_backend")
    except FileNotFoundError:
        problems["metadata.json"], backend = "missing", None
    except (OSError, ValueError, AttributeError) as err:
        problems["metadata.json"], backend = f"unreadable ({type(err).__name__}: {err})", None
    if not (path / "common.pt").is_file():
        problems["common.pt"] = "missing"
    if backend not in (None, "torch_dist"):
        return problems  # another megatron backend: its own files
    if not (path / ".metadata").is_file():
        problems[".metadata"] = "missing"
        return problems
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as err:  # a garbled pickle raises anything from EOFError to UnpicklingError
        problems[".metadata"] = f"unreadable ({type(err).__name__}: {' '.join(str(err).split())[:120]})"
        return problems
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        if not (path / name).is_file():
            problems[name] = "missing (listed in .metadata)"
        elif (size := (path / name).stat().st_size) < end:
            problems[name] = f"truncated: {size} bytes, .metadata needs {end}"
    return problems


def complete_steps(root: Path, before: int | None = None) -> list[int]:
    """Steps under checkpoints/ that are committed and whose files are all there (no hashing)."""
    if not Path(root).is_dir():
        return []
    steps = sorted(int(m.group(1)) for p in Path(root).iterdir() if (m := STEP_DIR.match(p.name)))
    return [
        s
        for s in steps
        if (before is None or s < before)
        and (Path(root) / f"step_{s:07d}" / mcore_io.META_FILE).is_file()
        and not storage_problems(Path(root) / f"step_{s:07d}")
    ]


def file_problems(ckpt_dir: Path) -> tuple[dict[str, str], dict | None]:
    """({file: problem}, the recorded checksums or None) of the whole checkpoint, on one process:
    the structural check, then every file against `checksums.json` when there is one. The
    structural finding wins for a file both find."""
    problems: dict[str, str] = {}
    try:
        sums = read_checksums(ckpt_dir)
    except (OSError, ValueError) as err:
        sums, problems = None, {CHECKSUM_FILE: f"unreadable ({err})"}
    if sums:
        problems = checksum_problems(ckpt_dir, sums, sorted(sums))
    problems.update(storage_problems(ckpt_dir))
    return problems, sums


def _damage_message(path: Path, what: str, problems: dict[str, str]) -> str:
    listed = "; ".join(f"{name}: {why}" for name, why in sorted(problems.items()))
    head = f"{what} {path} is damaged ({listed}): nothing was exported"
    step = STEP_DIR.match(path.name)
    earlier = complete_steps(path.parent, before=int(step.group(1))) if step else []
    if earlier:
        good = path.parent / f"step_{earlier[-1]:07d}"
        return (
            f"{head}. The previous complete checkpoint is {good} (complete steps: "
            f"{', '.join(map(str, earlier))}): export it instead, or restore {path.name}'s files from a copy"
        )
    if set(problems) == {CHECKSUM_FILE}:
        return f"{head}; delete {path / CHECKSUM_FILE} to export it unverified"
    return f"{head}; restore it from an intact copy, or reconvert it with tools/convert_hf_to_mcore.py"


def verify_files(path: Path, what: str = "--mcore-path") -> None:
    """Before an export reads `path`: raise DamagedCheckpointError naming its damaged file(s) and
    the fix (the previous complete step of a training run). The files megatron's `.metadata`
    lists must be there and long enough, and every file must match the size and CRC-32 its save
    recorded in checksums.json (when it has one: the trainer's checkpoints)."""
    started = time.perf_counter()
    problems, sums = file_problems(path)
    if problems:
        raise DamagedCheckpointError(_damage_message(path, what, problems))
    if sums:
        size = sum(int(e.get("size", 0)) for e in sums.values())
        log.info(
            f"{what} {path}: {len(sums)} files ({size / 1e9:.3f} GB) match {CHECKSUM_FILE} "
            f"(verified in {time.perf_counter() - started:.1f}s)"
        )
    elif STEP_DIR.match(path.name):  # a training checkpoint saved before checksums were recorded
        log.info(f"{what} {path} has no {CHECKSUM_FILE}: exporting it with the file-list check only")
