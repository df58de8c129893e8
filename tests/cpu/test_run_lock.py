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
