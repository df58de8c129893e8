"""One trainer per output directory (moe_sft/trainer/run_lock.py), with real processes.

A second process is refused while the first holds `output_dir/.lock`, and the error names the
holder; a holder killed with SIGKILL leaves a lock that the next run takes over with a note; where
flock is unavailable the JSON body and the holder's pid decide.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from moe_sft.config import ConfigError
from moe_sft.trainer import run_lock
from moe_sft.trainer.run_lock import RunLock, RunLockError

REPO = Path(__file__).resolve().parents[2]
HOLDER = textwrap.dedent("""
    import sys
    from moe_sft.trainer.run_lock import RunLock
    lock = RunLock.acquire(sys.argv[1])
    print("locked", flush=True)
    sys.stdin.read()        # hold until the test closes stdin
    if sys.argv[2] == "release":
        lock.release()
""")


def _holder(out: Path, end: str = "release") -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out), end],
        cwd=REPO,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_process_is_refused_with_the_holder_named(tmp_path):
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        with pytest.raises(RunLockError) as err:
            RunLock.acquire(out)
        msg = str(err.value)
        assert f"pid {holder.pid}" in msg and f"host {socket.gethostname()}" in msg and "started 20" in msg
        assert str(out) in msg and "trainer.output_dir" in msg
        body = json.loads((out / ".lock").read_text())  # the refused run wrote nothing
        assert body["pid"] == holder.pid and "-c" in body["command"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    lock = RunLock.acquire(out)  # released cleanly: taken without a note
    assert lock.note is None and json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_lock_of_a_killed_holder_is_taken_over_with_a_note(tmp_path):
    out = tmp_path / "run"
    holder = _holder(out, end="keep")
    holder.send_signal(signal.SIGKILL)  # what a node failure or `kill -9` leaves: the body stays
    holder.wait(timeout=30)
    lock = RunLock.acquire(out)
    try:
        assert lock.note and f"pid {holder.pid}" in lock.note and "not running" in lock.note
        assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def _no_flock(*args):
    raise OSError(errno.ENOLCK, "No locks available")


def test_without_flock_the_body_and_pid_decide(tmp_path, monkeypatch):
    """Some shared filesystems refuse flock (ENOLCK): a live holder on this host is still respected
    (a JSON body naming it), a dead one is taken over."""
    out = tmp_path / "run"
    holder = _holder(out, end="keep")
    monkeypatch.setattr(fcntl, "flock", _no_flock)
    try:
        with pytest.raises(RunLockError, match=f"pid {holder.pid}.*alive.*flock is not supported"):
            RunLock.acquire(out)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        lock = RunLock.acquire(out)
        assert lock.note and "not running" in lock.note
        lock.release()
    finally:
        holder.kill()


def test_a_reused_pid_is_not_a_live_holder():
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": 0.0}  # "started" before us
    assert not run_lock.holder_alive(me)
    assert run_lock.holder_alive(dict(me, started=9e12))
    assert not run_lock.holder_alive(dict(me, host="another-host", started=9e12))


def test_output_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile", tmp_path / "afile" / "run"):
        with pytest.raises(ConfigError, match=f"trainer.output_dir={out}: {tmp_path / 'afile'} is a file"):
            RunLock.acquire(out)


def test_stale_partial_checkpoints_are_removed(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_0000004.tmp" / "sub").mkdir(parents=True)
    (root / "step_0000002").mkdir()
    (root / "latest.tmp").write_text("4")
    (root / "latest").write_text("2")
    assert run_lock.remove_stale_partial_checkpoints(root) == [root / "step_0000004.tmp"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000002"]
    assert run_lock.remove_stale_partial_checkpoints(tmp_path / "absent") == []


FORKING_HOLDER = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time
    from moe_sft.trainer import guard
    from moe_sft.trainer.run_lock import RunLock
    if sys.argv[2] == "guarded":
        guard.forked_helpers_die_with_this_process()  # what the trainer does first
    lock = RunLock.acquire(sys.argv[1])
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    child.start()   # a checkpoint writer megatron forks per save
    print(child.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)   # the OOM killer, mid-save
""")


def _killed_forking_holder(out: Path, mode: str) -> psutil.Process:
    printed = out.with_name(out.name + ".out")  # a file: a surviving child would hold a pipe open
    with open(printed, "w") as stdout:
        proc = subprocess.run(
            [sys.executable, "-c", FORKING_HOLDER, str(out), mode],
            cwd=REPO,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    assert proc.returncode == -signal.SIGKILL, printed.read_text()[-2000:]
    return psutil.Process(int(printed.read_text().split()[0]))


def _gone(proc: psutil.Process, within: float) -> bool:
    try:
        proc.wait(timeout=within)
    except psutil.TimeoutExpired:
        return False
    except psutil.NoSuchProcess:
        pass
    return True


def test_a_child_forked_by_a_killed_holder_keeps_neither_the_lock_nor_running(tmp_path):
    """Killed mid-save, the trainer left megatron's forked writer running with the lock's open file
    (and its flock): the relaunch was refused as 'in use by another run: pid N', N long dead."""
    out = tmp_path / "run"
    child = _killed_forking_holder(out, "guarded")
    try:
        assert _gone(child, within=10), "the forked child outlived the process that forked it"
    finally:
        if not _gone(child, within=0):
            child.kill()
    unguarded = _killed_forking_holder(tmp_path / "run2", "plain")  # no parent-death signal: it lives on
    try:
        lock = RunLock.acquire(tmp_path / "run2")  # ... but does not hold the lock
        assert lock.note and "not running" in lock.note
        lock.release()
    finally:
        unguarded.kill()
    lock = RunLock.acquire(out)
    assert lock.note and "not running" in lock.note
    lock.release()


LEFTOVER = textwrap.dedent("""
    import fcntl, json, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    body = {"host": sys.argv[2], "pid": 999999, "started": 0.0, "started_at": "2026-01-01"}
    os.write(fd, json.dumps(body).encode())
    print("locked", flush=True)
    sys.stdin.read()
""")


def test_a_lock_held_by_a_leftover_of_a_dead_run_names_the_leftover(tmp_path):
    """The body names a run that is gone; the flock is held by a process that outlived it."""
    out = tmp_path / "run"
    out.mkdir()
    leftover = subprocess.Popen(
        [sys.executable, "-c", LEFTOVER, str(out / ".lock"), socket.gethostname()],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert leftover.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockError) as err:
            RunLock.acquire(out)
        msg = str(err.value)
        assert "the run that locked it (host " in msg and "pid 999999" in msg and "is gone" in msg
        assert f"still held by pid {leftover.pid}" in msg and f"(kill {leftover.pid})" in msg
    finally:
        leftover.kill()
        leftover.wait(timeout=30)


def test_a_lock_that_is_a_directory_is_named(tmp_path):
    (tmp_path / "run" / ".lock").mkdir(parents=True)
    with pytest.raises(RunLockError, match=r"\.lock is a directory, .*\(rmdir .*\.lock\) or set trainer.output_dir"):
        RunLock.acquire(tmp_path / "run")


def test_disk_full_advice_counts_the_checkpoint_a_save_writes_beside_the_kept_ones(tmp_path):
    """checkpoint.keep_last=1 still needs room for two checkpoints: the next one is written before
    the previous one is pruned (a failed save must not take the last good one with it)."""
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        (root / f"step_{step:07d}").mkdir(parents=True)
        (root / f"step_{step:07d}" / "__0_0.distcp").write_bytes(b"\0" * 3_000_000)
    (root / "step_0000006.tmp").mkdir()
    (root / "latest").write_text("4")
    msg = run_lock.disk_full_message(OSError(errno.ENOSPC, "No space left on device"), tmp_path, remove_partial=True)
    assert "checkpoints/latest still names step 4" in msg
    assert "needs room for keep_last + 1 checkpoints (2 with keep_last=1)" in msg
    assert "(about 3.0 MB each)" in msg and "older checkpoints here: step_0000002" in msg
    assert "lower checkpoint.keep_last" not in msg
