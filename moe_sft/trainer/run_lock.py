"""One trainer per output directory: `output_dir/.lock`, held by rank 0 for the whole run.

Two trainers on one `trainer.output_dir` would overwrite each other's checkpoints, `latest` and
config. Rank 0 takes an exclusive `fcntl.flock` on `output_dir/.lock` before it writes anything
there (before config.yaml, before any process group) and keeps the file open until the process
ends; the kernel drops the lock when the holder dies, however it dies. The file's body names the
holder (JSON: host, pid, start time, command, slurm job), so a second run's error says who holds
it, and a free lock with an unreleased body (the holder was killed) is taken over with a note.

Shared filesystems: flock is coherent across nodes on NFSv4, GPFS and Lustre mounted with
`-o flock`, but only node-local on Lustre `localflock`, and unsupported (ENOLCK/EOPNOTSUPP) on
some NFS setups. Where flock raises, the body is the fallback: a holder on this host whose pid is
alive (and started before the lock was written) is respected, any other holder is taken over with
a note. Where flock is node-local, a second run on another node is NOT stopped: the note names
the holder on the other host, but nothing blocks it. A requeued slurm job (same job id) always
takes over its own earlier lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from moe_sft.config import ConfigError

LOCK_NAME = ".lock"
# flock itself unavailable on this filesystem (as opposed to held by another process)
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunLockError(RuntimeError):
    """Another live run holds the output directory."""


def check_output_dir(out: Path) -> None:
    """`trainer.output_dir` must be a directory (or not exist yet): say so before anything."""
    out = Path(out)
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            raise ConfigError(
                f"trainer.output_dir={out}: {path} is a file, not a directory; "
                "remove it or set trainer.output_dir to another path"
            )
        if path.exists():
            return


def _body() -> dict:
    started = time.time()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": started,
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)),
        "command": " ".join([sys.executable, *sys.argv]),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def describe(holder: dict) -> str:
    job = f", slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} (started {holder.get('started_at', '?')}{job})"


def _read(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    try:
        holder = json.loads(raw.decode() or "null")
    except (ValueError, UnicodeDecodeError):
        return None
    return holder if isinstance(holder, dict) and not holder.get("released") else None


def _write(fd: int, body: dict) -> None:
    data = (json.dumps(body) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def holder_alive(holder: dict) -> bool:
    """The holder is a live process on this host (and not a later process that reused its pid)."""
    if holder.get("host") != socket.gethostname():
        return False
    import psutil

    try:
        proc = psutil.Process(int(holder["pid"]))
        return proc.create_time() <= float(holder.get("started", float("inf"))) + 1.0
    except (KeyError, TypeError, ValueError, psutil.Error):  # NoSuchProcess, AccessDenied, ...
        return False


class RunLock:
    """`RunLock.acquire(output_dir)` on rank 0; `release()` at the end (or the process dies)."""

    def __init__(self, path: Path, fd: int, note: str | None):
        self.path, self.fd, self.note = path, fd, note

    @classmethod
    def acquire(cls, out: Path) -> RunLock:
        check_output_dir(out)
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            note = cls._take(fd, path)
        except BaseException:
            os.close(fd)
            raise
        _write(fd, _body())
        return cls(path, fd, note)

    @staticmethod
    def _take(fd: int, path: Path) -> str | None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flock = True
        except BlockingIOError:
            holder = _read(fd) or {}
            raise RunLockError(
                f"{path.parent} is in use by another run: {describe(holder)}, command: "
                f"{holder.get('command', '?')}. Stop that run, or set trainer.output_dir to another "
                f"directory (the lock is {path})"
            ) from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                raise
            flock = False
        holder = _read(fd)
        if holder is None:
            return None
        same_job = holder.get("slurm_job_id") and holder.get("slurm_job_id") == os.environ.get("SLURM_JOB_ID")
        if not flock and not same_job and holder_alive(holder):
            raise RunLockError(
                f"{path.parent} is in use by another run: {describe(holder)} is alive "
                f"(flock is not supported here; {path} names it). Stop that run, or set "
                "trainer.output_dir to another directory"
            )
        if same_job:
            why = "the same slurm job, requeued"
        elif holder.get("host") != socket.gethostname():
            why = (
                "its lock is free here; if that run is still alive (flock not shared across nodes "
                "on this filesystem), stop one of them"
            )
        elif holder_alive(holder):
            why = "its process holds no lock"
        else:
            why = "it is not running"
        return f"took over the lock {path} of {describe(holder)}: {why}"

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            _write(self.fd, {"released": time.time()})
        except OSError:
            pass
        os.close(self.fd)  # drops the flock
        self.fd = -1


def remove_stale_partial_checkpoints(ckpt_root: Path) -> list[Path]:
    """`step_N.tmp` (a save that never committed: killed, disk full) and `latest.tmp`: nothing
    resumes from them and they can hold most of a full disk. Call only under the run lock."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    stale = sorted(p for p in root.iterdir() if p.name.startswith("step_") and p.name.endswith(".tmp"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    (root / "latest.tmp").unlink(missing_ok=True)
    return stale


def disk_full_message(err: BaseException, out: Path, remove_partial: bool) -> str | None:
    """A run that failed because the output filesystem is full (or over quota): one line naming the
    path and the free space, with the partial `step_N.tmp` removed (`remove_partial`: rank 0) and
    `latest` untouched (the previous checkpoint). None when `err` is something else.

    torch's zip writer reports ENOSPC as "unexpected pos ..." (the errno is lost), so a failure
    with a `step_N.tmp` present and (almost) no space left counts as disk full too."""
    chain, e = [], err
    while e is not None and len(chain) < 20:
        chain.append(e)
        e = e.__cause__ or e.__context__
    root = Path(out) / "checkpoints"
    try:
        usage = shutil.disk_usage(root if root.is_dir() else out)
    except OSError:
        return None
    partial = sorted(root.glob("step_*.tmp")) if root.is_dir() else []
    by_errno = [x for x in chain if getattr(x, "errno", None) in (errno.ENOSPC, errno.EDQUOT)]
    if not by_errno and not (partial and usage.free < max(64 << 20, usage.total // 1000)):
        return None
    where = partial[0] if partial else getattr(by_errno[0], "filename", None) or out
    if remove_partial:
        for path in partial:
            shutil.rmtree(path, ignore_errors=True)
    pointer = root / "latest"
    latest = pointer.read_text().strip() if pointer.is_file() else None
    return (
        f"no space left writing {where} ({_size(usage.free)} free of {_size(usage.total)} "
        "on that filesystem): "
        + (f"removed the partial {', '.join(p.name for p in partial)}; " if remove_partial and partial else "")
        + (
            f"checkpoints/latest still names step {int(latest)}"
            if latest and latest.isdigit()
            else "no checkpoint was completed"
        )
        + "; free space (or lower checkpoint.keep_last) and run the same command again"
    )


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.0f} kB"
