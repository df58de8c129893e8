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


def _processes_with_open(path: Path) -> list:
    """The processes of this host that have `path` open (those visible to this user)."""
    import psutil

    target, found = os.path.realpath(path), []
    for proc in psutil.process_iter(["pid"]):
        try:
            if any(os.path.realpath(f.path) == target for f in proc.open_files()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _held_message(holder: dict, path: Path) -> str:
    """Why the flock on `path` is held: the run its body names, or, when that run is gone, the
    leftover processes that still hold it (forked by it before it was killed)."""
    if holder.get("host") == socket.gethostname() and not holder_alive(holder):
        pids = [p.pid for p in _processes_with_open(path) if p.pid != os.getpid()]
        leftover = ", ".join(f"pid {p}" for p in pids) or "a process this user cannot see"
        return (
            f"{path.parent}: the run that locked it ({describe(holder)}) is gone, but its lock {path} is still "
            f"held by {leftover}, left over from that run (a helper it forked, e.g. a checkpoint writer, that "
            f"outlived it). Kill {'it' if len(pids) <= 1 else 'them'}"
            + (f" (kill {' '.join(map(str, pids))})" if pids else "")
            + " and run the same command again, or set trainer.output_dir to another directory"
        )
    return (
        f"{path.parent} is in use by another run: {describe(holder)}, command: "
        f"{holder.get('command', '?')}. Stop that run, or set trainer.output_dir to another "
        f"directory (the lock is {path})"
    )


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
        if path.is_dir():
            raise RunLockError(
                f"{path} is a directory, but moe-sft keeps its run lock in a file of that name: remove "
                f"it (rmdir {path}) or set trainer.output_dir to another directory"
            )
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            note = cls._take(fd, path)
        except BaseException:
            os.close(fd)
            raise
        _write(fd, _body())
        lock = cls(path, fd, note)
        os.register_at_fork(after_in_child=lock._drop_in_child)
        return lock

    def _drop_in_child(self) -> None:
        """A forked child (megatron's checkpoint writers are forked per save) shares the lock's open
        file and with it the flock: killed with its parent, it would hold the run's lock until it
        ended. The child closes its copy; the parent's lock is untouched."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @staticmethod
    def _take(fd: int, path: Path) -> str | None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flock = True
        except BlockingIOError:
            raise RunLockError(_held_message(_read(fd) or {}, path)) from None
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
        + _room_advice(root, latest, usage.free)
    )


def _room_advice(root: Path, latest: str | None, free: int) -> str:
    """What a save needs: it writes the next checkpoint beside the kept ones and prunes only after
    the commit (a failed save must not take the last good one with it), so the disk needs room for
    checkpoint.keep_last + 1 checkpoints; lowering keep_last alone frees nothing now."""
    committed = sorted(p for p in root.glob("step_???????") if p.is_dir()) if root.is_dir() else []
    newest = root / f"step_{int(latest):07d}" if latest and latest.isdigit() else None
    size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) if newest and newest.is_dir() else 0
    older = [p.name for p in committed if p != newest]
    need = f" (about {_size(size)} each)" if size else ""
    return (
        f"; a save writes the next checkpoint{need} before it prunes to checkpoint.keep_last, so the disk "
        "needs room for keep_last + 1 checkpoints (2 with keep_last=1)"
        + (f": free at least {_size(size - free)}" if size > free else ": free space")
        + (f" (older checkpoints here: {', '.join(older)})" if older else "")
        + " and run the same command again"
    )


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.0f} kB"
