"""Nothing is lost and nothing trains on garbage (torchrun, gloo, CPU, one rank).

* A run killed while writing a checkpoint (files written, not committed) resumes from the previous
  complete one; a run stopped by SIGTERM saves and resumes; both continue with exactly the losses
  of a straight run.
* Non-finite gradient norms and losses skip the step (no update, LR schedule not advanced), are
  counted, and stop the run after `trainer.max_skipped_steps_in_a_row`.
* Frozen parameters (router, a name pattern) leave the run unchanged; the rest trains.
"""

from __future__ import annotations

import math
import signal
import subprocess

import psutil
import pytest

from tests.dist.launch import REPO, clean_env, make_tiny_model, step_metrics, tiny_run_overrides, torchrun, torchrun_cmd

STRAIGHT_STEPS = 6


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("robust"))


def _overrides(tmp, name, max_steps, *extra):
    return tiny_run_overrides(tmp, tmp / name, max_steps, *extra)


@pytest.fixture(scope="module")
def straight(model_dirs):
    return step_metrics(torchrun(1, _overrides(model_dirs, "straight", STRAIGHT_STEPS)).stdout)


def _assert_same_losses(reference, metrics):
    for step, values in metrics.items():
        assert values["loss"] == pytest.approx(reference[step]["loss"], rel=1e-3), (step, metrics)


def test_killed_mid_save_and_sigterm_both_resume_exactly(model_dirs, straight):
    tmp = model_dirs
    ckpts = tmp / "crashy" / "checkpoints"
    # 1. Killed while writing the step-4 checkpoint: its files exist, uncommitted.
    died = torchrun(1, _overrides(tmp, "crashy", 4, "checkpoint.save_interval=2"), check=False, faults="kill_in_save=4")
    assert died.returncode != 0
    assert (ckpts / "latest").read_text().strip() == "2"
    assert (ckpts / "step_0000004.tmp").is_dir() and not (ckpts / "step_0000004").exists()
    # 2. Resumes from step 2; SIGTERM to the worker once step 3 is logged: it saves and exits 0.
    proc = subprocess.Popen(
        torchrun_cmd(1, _overrides(tmp, "crashy", STRAIGHT_STEPS)),
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 3/"):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    if "moe_sft.train" in " ".join(child.cmdline()):
                        child.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, "".join(lines[-40:])
    finally:
        proc.kill()
    out = "".join(lines)
    assert "resumed from" in out and "at step 2" in out
    stopped = [ln for ln in lines if "stopped by SIGTERM after step" in ln]
    assert stopped, out[-3000:]
    stop_step = int(stopped[0].split("after step ")[1].split(";")[0])
    second = step_metrics(out)
    assert sorted(second) == list(range(3, stop_step + 1))
    assert not (ckpts / "step_0000004.tmp").exists() or stop_step < 4  # a later save replaces it
    # 3. The next launch resumes after the signal's checkpoint and finishes.
    third = step_metrics(torchrun(1, _overrides(tmp, "crashy", STRAIGHT_STEPS)).stdout)
    assert sorted(third) == list(range(stop_step + 1, STRAIGHT_STEPS + 1))
    _assert_same_losses(straight, {**second, **third})


def test_async_saves_commit_in_the_background_and_resume_exactly(model_dirs, straight):
    """checkpoint.async_save on 2 ranks: the writer runs while training goes on, a save is committed
    only once written (killed at the step-4 commit: `latest` stays 2), and the resume from the
    background-written step 2 continues with the straight run's losses and consumed-token count."""
    tmp = model_dirs
    ckpts = tmp / "async" / "checkpoints"
    died = torchrun(
        2,
        _overrides(tmp, "async", 4, "checkpoint.save_interval=2", "checkpoint.async_save=true"),
        check=False,
        faults="kill_in_save=4",
    )
    assert died.returncode != 0
    assert "checkpoint step 2: writing in the background" in died.stdout
    assert "in the background)" in died.stdout  # step 2 committed by a later poll
    first = step_metrics(died.stdout)
    assert sorted(first) == [1, 2, 3, 4]  # training went on while step 2 was written
    assert (ckpts / "latest").read_text().strip() == "2"
    assert (ckpts / "step_0000004.tmp").is_dir() and not (ckpts / "step_0000004").exists()
    resumed = torchrun(2, _overrides(tmp, "async", STRAIGHT_STEPS, "checkpoint.async_save=true"))
    assert "at step 2" in resumed.stdout and (ckpts / "latest").read_text().strip() == str(STRAIGHT_STEPS)
    second = step_metrics(resumed.stdout)
    assert sorted(second) == list(range(3, STRAIGHT_STEPS + 1))
    _assert_same_losses(straight, {**first, **second})
    # the token count is restored with the step (2 ranks here, 1 straight: the same global batches)
    assert second[STRAIGHT_STEPS]["consumed_tokens"] == straight[STRAIGHT_STEPS]["consumed_tokens"] > 0


def test_stop_file_is_honoured_and_consumed(model_dirs, straight):
    """What an sbatch trap does: create output_dir/STOP; the run saves, removes it and exits."""
    tmp = model_dirs
    (tmp / "stopfile").mkdir()
    (tmp / "stopfile" / "STOP").touch()
    first = torchrun(1, _overrides(tmp, "stopfile", STRAIGHT_STEPS)).stdout
    assert "stopped by file" in first and "after step 1" in first
    assert not (tmp / "stopfile" / "STOP").exists()
    second = step_metrics(torchrun(1, _overrides(tmp, "stopfile", 2)).stdout)
    assert sorted(second) == [2]
    _assert_same_losses(straight, second)


def test_non_finite_steps_are_skipped_then_stop_the_run(model_dirs, straight):
    proc = torchrun(1, _overrides(model_dirs, "nan", STRAIGHT_STEPS), check=False, faults="nan_grad=2;nan_loss=3,4")
    metrics = step_metrics(proc.stdout)
    assert proc.returncode != 0 and "exitcode  : 3" in proc.stderr, proc.stderr[-3000:]  # torchrun: 1
    assert "steps 2..4: 3 steps in a row had a non-finite loss or gradient norm" in proc.stderr
    assert metrics[1]["loss"] == pytest.approx(straight[1]["loss"], rel=1e-3)
    assert math.isnan(metrics[2]["grad_norm"]) and metrics[2]["skipped_steps"] == 1
    assert math.isnan(metrics[3]["loss"]) and metrics[3]["skipped_steps"] == 2
    # No update and no schedule step on skipped steps: the LR stays at step 1's value.
    assert metrics[2]["lr"] == metrics[3]["lr"] == straight[1]["lr"] != straight[2]["lr"]
    assert 4 not in metrics or metrics[4].get("skipped_steps") == 3


def test_frozen_router_and_pattern_stay_unchanged(model_dirs):
    import torch

    from moe_sft.conversion.export import load_model_from_checkpoint
    from moe_sft.trainer.checkpoint import step_dir

    out = torchrun(
        1,
        _overrides(
            model_dirs,
            "frozen",
            2,
            "model.freeze_router=true",
            "model.freeze_patterns=[embedding.*,decoder.layers.1.self_attention.*]",
        ),
    )
    assert "froze" in out.stdout
    before = load_model_from_checkpoint(model_dirs / "mcore").state_dict()
    after = load_model_from_checkpoint(step_dir(model_dirs / "frozen" / "checkpoints", 2)).state_dict()
    frozen = [
        k
        for k in before
        if isinstance(before[k], torch.Tensor)
        and (".router." in k or k.startswith("embedding.") or k.startswith("decoder.layers.1.self_attention."))
    ]
    trained = [
        k
        for k in before
        if isinstance(before[k], torch.Tensor)
        and k not in frozen
        and before[k].is_floating_point()
        and "_extra_state" not in k
    ]
    assert frozen and trained
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert all(
        not torch.equal(before[k], after[k])
        for k in trained
        if k.startswith("decoder.layers.0.self_attention.linear_qkv")
    )
    bad = torchrun(1, _overrides(model_dirs, "frozen_bad", 1, "model.freeze_patterns=[decoder.layer.*]"), check=False)
    assert bad.returncode != 0 and "exitcode  : 2" in bad.stderr  # torchrun itself exits 1
    assert "model.freeze_patterns ['decoder.layer.*'] match no parameter" in bad.stderr
