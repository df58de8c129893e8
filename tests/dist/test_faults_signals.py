"""Faults as they happen on a cluster, through torchrun (gloo, CPU, one rank).

* Pre-emption: SIGTERM to torchrun (what the batch script's `kill` or a launcher does) and SIGTERM
  to every process of the job (slurm's scancel) both end the run with a committed checkpoint at a
  step boundary, and the relaunch continues with exactly the straight run's losses.
* A finished run launched again says there is nothing to train (or exports) and exits 0.
* A second run on an output directory in use is refused, naming the holder, before any work.
* A full disk: the failed save is named with the free space, its `.tmp` removed, `latest` intact;
  a stale `.tmp` that fills the disk is removed at startup.
* A collapsed run (gradient norm exactly 0 step after step) is warned about.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.dist.launch import REPO, clean_env, make_tiny_model, step_metrics, tiny_run_overrides, torchrun_cmd

STEPS = 6


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("faults"))


def _overrides(tmp, name, max_steps, *extra):
    return tiny_run_overrides(tmp, tmp / name, max_steps, *extra)


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _launch(overrides) -> subprocess.Popen:
    return subprocess.Popen(
        torchrun_cmd(1, overrides), cwd=REPO, env=clean_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _run(overrides, timeout=300) -> subprocess.CompletedProcess:
    """torchrun to the end; a hang fails the test (and its whole process tree is killed)."""
    proc = _launch(overrides)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"no exit within {timeout}s (hung); last output:\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _trainer_pid(proc: subprocess.Popen) -> int:
    return next(
        c.pid for c in psutil.Process(proc.pid).children(recursive=True) if "moe_sft.train" in " ".join(c.cmdline())
    )


@pytest.fixture(scope="module")
def straight(model_dirs):
    proc = _run(_overrides(model_dirs, "straight", STEPS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return step_metrics(proc.stdout)


def _assert_same_losses(reference, metrics):
    assert metrics
    for step, values in metrics.items():
        assert values["loss"] == pytest.approx(reference[step]["loss"], rel=1e-3), (step, metrics)


@pytest.mark.parametrize("target", ["torchrun", "every_process", "ctrl_c"])
def test_sigterm_through_torchrun_commits_the_stop_checkpoint(model_dirs, straight, target):
    """`kill -TERM <torchrun>`: torchrun forwards it to the worker's process group, where megatron's
    checkpoint-results manager used to die of it (the stop save failed, only step_N.tmp was left:
    with save_interval=0 everything was lost). scancel signals every process: the same. Ctrl-C
    (SIGINT to the terminal's foreground group: torchrun, which forwards it) stops the same way;
    it used to end the run without a checkpoint."""
    tmp = model_dirs
    ckpts = tmp / f"term_{target}" / "checkpoints"
    proc = subprocess.Popen(
        torchrun_cmd(1, _overrides(tmp, f"term_{target}", STEPS, "checkpoint.save_interval=0")),
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=target == "ctrl_c",  # its own foreground group, as in a terminal
    )
    lines, tree = [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 3/") and not tree:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                if target == "ctrl_c":
                    os.killpg(proc.pid, signal.SIGINT)
                # scancel signals every process of the job: the launcher, the trainer, its helpers
                for p in [] if target == "ctrl_c" else tree if target == "every_process" else tree[:1]:
                    p.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        _kill_tree(proc)
    out = "".join(lines)
    assert tree, out[-3000:]
    name = "SIGINT" if target == "ctrl_c" else "SIGTERM"
    stopped = [ln for ln in lines if f"stopped by {name} after step" in ln]
    assert stopped, out[-4000:]
    stop_step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert (ckpts / "latest").read_text().strip() == str(stop_step), out[-4000:]
    assert not list(ckpts.glob("*.tmp")) and "ConnectionRefusedError" not in out
    # no helper outlives the run (the results manager ignores SIGTERM but exits with the trainer)
    deadline = time.time() + 10
    while time.time() < deadline and [p for p in tree if _alive(p)]:
        time.sleep(0.5)
    assert not [p.cmdline() for p in tree if _alive(p)]
    first = step_metrics(out)
    resumed = _run(_overrides(tmp, f"term_{target}", STEPS, "checkpoint.save_interval=0"))
    assert resumed.returncode == 0 and f"at step {stop_step}" in resumed.stdout, resumed.stderr[-3000:]
    second = step_metrics(resumed.stdout)
    assert sorted(second) == list(range(stop_step + 1, STEPS + 1))
    _assert_same_losses(straight, {**first, **second})


def test_finished_run_has_nothing_to_train(model_dirs, straight):
    """Launched again after its last step (or with a smaller max_steps), a run used to hang on exit
    (the checkpoint writer's manager process was still starting); a stale `.tmp` is removed."""
    tmp = model_dirs
    shutil.copytree(tmp / "straight" / "checkpoints", tmp / "done" / "checkpoints")
    stale = tmp / "done" / "checkpoints" / "step_0000009.tmp"
    stale.mkdir()
    (stale / "blob").write_bytes(b"x" * 1000)
    again = _run(_overrides(tmp, "done", STEPS), timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        f"nothing to train: {tmp / 'done' / 'checkpoints' / 'step_0000006'} is step 6 and trainer.max_steps=6"
        in again.stdout
    )
    assert not step_metrics(again.stdout) and not stale.exists() and f"removed {stale}" in again.stdout
    fewer = _run(_overrides(tmp, "done", 3, "trainer.export_hf_at_end=true"), timeout=240)
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    assert "is step 6 and trainer.max_steps=3; exporting it" in fewer.stdout
    assert (tmp / "done" / "hf" / "config.json").is_file() and not step_metrics(fewer.stdout)


def test_second_run_on_an_output_dir_in_use_is_refused(model_dirs):
    tmp = model_dirs
    first = _launch(_overrides(tmp, "locked", 500))
    try:
        for line in first.stdout:
            if line.startswith("step 1/"):
                break
        holder = _trainer_pid(first)
        config_mtime = (tmp / "locked" / "config.yaml").stat().st_mtime_ns
        second = _run(_overrides(tmp, "locked", 500), timeout=240)
        assert first.poll() is None, "the first run ended before the second was refused"
        (tmp / "locked" / "STOP").touch()  # the first run saves and stops
        first.communicate(timeout=120)
    finally:
        _kill_tree(first)
    assert second.returncode != 0 and "exitcode  : 2" in second.stderr, second.stderr[-3000:]
    assert f"error: {tmp / 'locked'} is in use by another run: host " in second.stderr
    assert f" pid {holder} (started 20" in second.stderr
    assert "world=" not in second.stdout  # refused before any process group
    assert (tmp / "locked" / "config.yaml").stat().st_mtime_ns == config_mtime
    assert first.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A 26 MB tmpfs: one checkpoint of the tiny model (17 MB) fits, two do not (needs root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=26m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root to mount a small tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_save_is_one_line_and_keeps_the_previous_checkpoint(model_dirs, small_disk):
    tmp = model_dirs
    ckpts = small_disk / "run" / "checkpoints"
    full = _run(_overrides(tmp, small_disk / "run", STEPS, "checkpoint.save_interval=2"))
    assert full.returncode != 0 and "exitcode  : 4" in full.stderr, full.stderr[-3000:]
    line = next(ln for ln in full.stderr.splitlines() if ln.startswith("error: no space left"))
    assert f"writing {ckpts / 'step_0000004.tmp'} (" in line and " free of 27.3 MB" in line
    assert "removed the partial step_0000004.tmp; checkpoints/latest still names step 2" in line
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_0000002"]
    # what an older run (killed mid-save) leaves: a stale .tmp filling the disk. The relaunch
    # removes it before it writes config.yaml, resumes and trains.
    stale = ckpts / "step_0000004.tmp"
    stale.mkdir()
    (stale / "blob").write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - 4096))
    relaunch = _run(_overrides(tmp, small_disk / "run", 3, "checkpoint.save_at_end=false"))
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert f"removed {stale}" in relaunch.stdout and sorted(step_metrics(relaunch.stdout)) == [3]


def test_output_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_sft.train",
            "--config-path",
            "recipes",
            "--config-name",
            "quickstart",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"trainer.output_dir={tmp_path / 'run'}: {tmp_path / 'run'} is a file, not a directory" in proc.stderr


def test_collapsed_run_is_warned_about(model_dirs):
    """lr=1e6 collapses the tiny model at step 3: the gradient norm is exactly 0 from then on."""
    proc = _run(_overrides(model_dirs, "collapsed", 8, "optimizer.lr=1e6"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = step_metrics(proc.stdout)
    assert [s for s in metrics if metrics[s]["grad_norm"] == 0] == [3, 4, 5, 6, 7, 8]
    warnings = [ln for ln in proc.stdout.splitlines() if "gradient norm exactly 0 for" in ln]
    assert len(warnings) == 1 and "5 steps in a row (steps 3..7" in warnings[0], proc.stdout[-3000:]
    assert "WARNING: gradient norm exactly 0 in steps 3..8 (6 steps)" in proc.stdout


def test_a_rank_killed_mid_save_leaves_no_writer_holding_the_lock(model_dirs):
    """SIGKILL of the trainer (the OOM killer) while megatron's forked writer writes its checkpoint:
    the writer used to live on (blocked on a queue whose reader was gone) holding the run's lock,
    and the relaunch was refused as "in use by another run: pid N", N dead."""
    tmp = model_dirs
    overrides = _overrides(tmp, "oom", 3, "checkpoint.save_interval=2")
    proc = subprocess.Popen(
        torchrun_cmd(1, overrides, faults="kill_in_write=2"),
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.DEVNULL,  # files, not pipes: a surviving writer would keep a pipe open
        stderr=subprocess.DEVNULL,
    )
    try:
        proc.wait(timeout=300)
        writer = psutil.Process(int((tmp / "oom" / "writer.pid").read_text()))
    except psutil.NoSuchProcess:
        writer = None
    finally:
        _kill_tree(proc)
    try:
        assert proc.returncode != 0
        assert writer is None or not _alive(writer) or _gone_within(writer, 10), "the writer outlived the trainer"
    finally:
        if writer is not None and _alive(writer):
            writer.kill()
    relaunch = _run(overrides)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert "in use by another run" not in relaunch.stderr
    assert f"removed {tmp / 'oom' / 'checkpoints' / 'step_0000002.tmp'}" in relaunch.stdout
    assert sorted(step_metrics(relaunch.stdout)) == [1, 2, 3]


def _gone_within(proc: psutil.Process, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline and _alive(proc):
        time.sleep(0.2)
    return not _alive(proc)
