"""Checkpoints that must not be trusted are neither written nor loaded (CPU, gloo).

* An update that overflows the weights (optimizer.lr=1e38: finite loss and grad norm at step 1,
  non-finite weights after it) is never checkpointed: no committed step holds NaN/Inf, the run
  stops with exit 3 and says why.
* A resume checkpoint with a truncated shard, a flipped bit, a garbled `.metadata` or
  moe_sft_meta.json, or an edited hf/config.json, and a truncated base checkpoint
  (model.mcore_path), stop before any data or weights are loaded with one line naming the file
  (and the previous complete step), exit 2, no traceback.
* Resuming with model.mcore_path at another architecture is an error naming both; at the same
  architecture from another source, the run resumes from its own checkpoint with a warning (and
  a checkpoint without checksums.json, as older runs wrote, loads with a note).

One 2-rank run makes the checkpoints; the damaged copies are relaunched as one process each.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.launch import REPO, clean_env, make_tiny_model, step_metrics, tiny_run_overrides, torchrun


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("faults_ckpt"))


def _overrides(tmp: Path, out: Path, max_steps: int, *extra: str) -> list[str]:
    return tiny_run_overrides(tmp, out, max_steps, "trainer.eval_interval=0", *extra)


def _train_one_process(overrides: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moe_sft.train", "--config-path", "recipes", "--config-name", "quickstart", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)


def _non_finite(ckpt: Path, scratch: Path) -> list[str]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(scratch))

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor) and v.is_floating_point():
                yield f"{prefix}{k}", v

    return [k for k, v in walk(torch.load(scratch, weights_only=False)) if not torch.isfinite(v).all()]


def test_weights_made_non_finite_by_an_update_are_never_checkpointed(model_dirs):
    out = model_dirs / "poisoned"
    proc = torchrun(
        2,
        _overrides(
            model_dirs, out, 3, "optimizer.lr=1e38", "optimizer.lr_warmup_steps=0", "checkpoint.save_interval=1"
        ),
        check=False,
    )
    assert proc.returncode != 0 and "exitcode  : 3" in proc.stderr, proc.stderr[-3000:]
    assert "hold NaN or Inf (decoder." in proc.stderr and "Lower optimizer.lr (now 1e+38)" in proc.stderr
    assert "so this checkpoint is not saved" in proc.stderr and "starts again from model.mcore_path" in proc.stderr
    root = out / "checkpoints"
    committed = sorted(root.glob("step_???????")) if root.is_dir() else []
    for ckpt in committed:
        assert _non_finite(ckpt, model_dirs / "poisoned.pt") == [], ckpt
    if (root / "latest").exists():
        assert (root / f"step_{int((root / 'latest').read_text()):07d}") in committed


@pytest.fixture(scope="module")
def saved_run(model_dirs):
    """Steps 1 and 2 saved by 2 ranks (each hashes its own shards)."""
    out = model_dirs / "run"
    proc = torchrun(2, _overrides(model_dirs, out, 2, "checkpoint.save_interval=1", "checkpoint.keep_last=3"))
    return out, proc.stdout


def test_every_save_records_checksums(saved_run):
    out, stdout = saved_run
    assert stdout.count("CRC-32 of") == 2
    for step in (1, 2):
        sums = json.loads((out / "checkpoints" / f"step_{step:07d}" / "checksums.json").read_text())["files"]
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "common.pt", "metadata.json"} <= set(sums)


def _damage(path: Path, how: str) -> str:
    """Damages the checkpoint at `path`; returns the file it names."""
    shard = path / "__1_0.distcp"
    if how == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how == "flipped_bit":
        data = bytearray(shard.read_bytes())
        data[len(data) * 3 // 4] ^= 0x20
        shard.write_bytes(bytes(data))
    elif how == "garbled_dot_metadata":
        (path / ".metadata").write_bytes(b"\x80\x04garbage" * 10)
        return ".metadata"
    elif how == "garbled_meta":  # used to say "reconvert it": a training checkpoint is not converted
        (path / "moe_sft_meta.json").write_text('{"family": "qwen3_m')
        return "moe_sft_meta.json"
    return shard.name


def _assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-3000:]
    assert "train data:" not in proc.stdout  # stopped before the data was read
    return proc.stderr


@pytest.mark.parametrize("how", ["truncated_shard", "flipped_bit", "garbled_dot_metadata", "garbled_meta"])
def test_damaged_resume_checkpoint_names_the_file_and_the_previous_step(model_dirs, saved_run, how):
    out = model_dirs / f"damaged_{how}"
    shutil.copytree(saved_run[0], out)
    bad = _damage(out / "checkpoints" / "step_0000002", how)
    proc = _train_one_process(_overrides(model_dirs, out, 3))
    _assert_clean_error(
        proc,
        "resume checkpoint",
        f"step_0000002 is damaged ({bad}: ",
        "previous complete checkpoint is step 1",
        str(out / "checkpoints" / "latest"),
    )


def test_an_edited_model_config_in_the_resume_checkpoint_is_refused(model_dirs, saved_run):
    """The resume builds the model from the checkpoint's hf/config.json; an edited rope_theta there
    was used silently (checksums.json did not cover it)."""
    out = model_dirs / "edited_config"
    shutil.copytree(saved_run[0], out)
    config = out / "checkpoints" / "step_0000002" / "hf" / "config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), rope_theta=12345.0)))
    proc = _train_one_process(_overrides(model_dirs, out, 3))
    stderr = _assert_clean_error(proc, "step_0000002: hf/config.json changed after the save", "Restore it")
    assert "previous complete checkpoint is step 1" in stderr


def test_damaged_base_checkpoint_names_the_file(model_dirs):
    base = model_dirs / "mcore_truncated"
    shutil.copytree(model_dirs / "mcore", base)
    shard = sorted(base.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = _train_one_process(_overrides(model_dirs, model_dirs / "fresh", 1, f"model.mcore_path={base}"))
    _assert_clean_error(
        proc, f"model.mcore_path {base} is damaged ({shard.name}: truncated: 1000 bytes", "reconvert it"
    )


def test_resume_with_another_model_in_model_mcore_path(model_dirs, saved_run):
    other = make_tiny_model(model_dirs / "bigger", hidden_size=192)
    out = model_dirs / "other_arch"
    shutil.copytree(saved_run[0], out)
    proc = _train_one_process(_overrides(model_dirs, out, 3, f"model.mcore_path={other / 'mcore'}"))
    _assert_clean_error(
        proc,
        "holds another model than model.mcore_path",
        "hidden=128 vs 192",
        "new trainer.output_dir",
        f"point model.mcore_path back at {(model_dirs / 'mcore').resolve()}",
    )

    # Same architecture, converted from another source: the run's own checkpoint wins, with a
    # warning; its step 2, without checksums.json (an older run's), loads with a note.
    same = model_dirs / "mcore_other_source"
    shutil.copytree(model_dirs / "mcore", same)
    meta = json.loads((same / "moe_sft_meta.json").read_text())
    (same / "moe_sft_meta.json").write_text(json.dumps(dict(meta, source="/elsewhere/other-model")))
    out = model_dirs / "other_source"
    shutil.copytree(saved_run[0], out)
    (out / "checkpoints" / "step_0000002" / "checksums.json").unlink()
    proc = _train_one_process(_overrides(model_dirs, out, 3, f"model.mcore_path={same}"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    warning = [ln for ln in proc.stdout.splitlines() if "warning: resuming from this run's own checkpoint" in ln]
    assert len(warning) == 1 and "/elsewhere/other-model" in warning[0] and "is not used" in warning[0]
    assert "has no checksums.json" in proc.stdout and "at step 2" in proc.stdout
    assert sorted(step_metrics(proc.stdout)) == [3]
