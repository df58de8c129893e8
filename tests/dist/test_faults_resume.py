"""What a relaunch changes is what it trains with, and a fresh start loses nothing (CPU, gloo, one rank).

* A resume with another optimizer.lr / optimizer.min_lr (or peft.lr for a LoRA run) trains on the
  recipe's schedule, not the checkpoint's, and says so in one line.
* checkpoint.resume=never in a directory holding an earlier run's (higher) steps moves them aside:
  the new run's own steps are not pruned, `latest` names one of them, and the relaunch resumes it.
* A resume with another peft.alpha is refused by name (it would change the trained model).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moe_sft.config import ConfigError
from tests.dist.launch import make_tiny_model, step_metrics, tiny_run_overrides, torchrun

LORA = ["peft.method=lora", "peft.rank=8", "peft.target_modules=[attention,experts]"]
RECIPE_LR = {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup": 10}  # recipes/quickstart.yaml


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("faults_resume"))


def _overrides(tmp: Path, name: str, max_steps: int, *extra: str) -> list[str]:
    return tiny_run_overrides(tmp, tmp / name, max_steps, "trainer.eval_interval=0", *extra)


@pytest.mark.parametrize(("method", "lr_field"), [("full", "optimizer.lr"), ("lora", "peft.lr")])
def test_a_changed_learning_rate_on_resume_is_trained_with(model_dirs, method, lr_field):
    extra = LORA if method == "lora" else []
    name = f"lr_{method}"
    first = torchrun(1, _overrides(model_dirs, name, 2, *extra))
    assert step_metrics(first.stdout)[2]["lr"] == pytest.approx(RECIPE_LR["lr"] * 2 / RECIPE_LR["warmup"])
    resumed = torchrun(1, _overrides(model_dirs, name, 3, *extra, f"{lr_field}=1e-5", "optimizer.min_lr=1e-6"))
    assert "at step 2" in resumed.stdout, resumed.stdout[-3000:]
    # linear warmup from 0 over 10 steps to the recipe's new peak: step 3 trains at 3/10 of 1e-5
    assert step_metrics(resumed.stdout)[3]["lr"] == pytest.approx(1e-5 * 3 / RECIPE_LR["warmup"], rel=1e-3)
    line = [ln for ln in resumed.stdout.splitlines() if "the recipe's optimizer settings win" in ln]
    assert len(line) == 1 and "lr 0.003 -> 1e-05" in line[0] and "min_lr 0.0003 -> 1e-06" in line[0], line


def test_resume_never_sets_the_earlier_runs_steps_aside(model_dirs):
    """An earlier run's steps 30 and 40 outranked the new run's: keep_last pruned the new steps
    right after they were saved and `latest` named a deleted one."""
    earlier = torchrun(1, _overrides(model_dirs, "earlier", 1))
    assert earlier.returncode == 0
    ckpts = model_dirs / "earlier" / "checkpoints"
    for step in (30, 40):
        shutil.copytree(ckpts / "step_0000001", ckpts / f"step_{step:07d}")
    shutil.rmtree(ckpts / "step_0000001")
    (ckpts / "latest").write_text("40")
    fresh = torchrun(
        1,
        _overrides(
            model_dirs, "earlier", 2, "checkpoint.resume=never", "checkpoint.save_interval=1", "checkpoint.keep_last=2"
        ),
    )
    aside = sorted(ckpts.glob("earlier_run_*"))
    assert len(aside) == 1, sorted(p.name for p in ckpts.iterdir())
    assert f"steps 30, 40) and `latest` to {aside[0]}" in fresh.stdout
    assert sorted(p.name for p in aside[0].iterdir()) == ["latest", "step_0000030", "step_0000040"]
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_0000001", "step_0000002"]
    assert (ckpts / "latest").read_text().strip() == "2"
    relaunch = torchrun(1, _overrides(model_dirs, "earlier", 3))
    assert "at step 2" in relaunch.stdout and sorted(step_metrics(relaunch.stdout)) == [3]


def test_another_peft_alpha_on_resume_is_refused(model_dirs):
    from moe_sft.config import PeftConfig
    from moe_sft.peft import run_meta

    mcore = model_dirs / "mcore"
    trained = PeftConfig(method="lora", rank=8, alpha=16.0)
    meta = run_meta.record(trained, mcore)
    run_meta.check_resume(meta, trained, mcore, Path("ckpt"))  # the same adapters resume
    with pytest.raises(ConfigError, match=r"peft.alpha=32.0 \(checkpoint: 16.0\)"):
        run_meta.check_resume(meta, PeftConfig(method="lora", rank=8, alpha=32.0), mcore, Path("ckpt"))
