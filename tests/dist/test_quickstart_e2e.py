"""The quickstart end to end through torchrun on CPU (gloo, fp32): convert → train → checkpoint →
resume → export → load with plain transformers. Also resume equivalence:
4 steps straight vs 2 + resume + 2 give the same losses; the straight run also evaluates every 2
steps, so the equality shows that evaluation changes neither the model nor the data position."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.dist.launch import losses, step_metrics, torchrun_cases


def train_overrides(tmp: Path, run_name: str, max_steps: int, extra=()) -> list[str]:
    return [
        f"trainer.max_steps={max_steps}",
        "trainer.log_interval=1",
        "checkpoint.save_interval=2",
        f"trainer.output_dir={tmp / run_name}",
        f"model.hf_path={tmp / 'tiny_hf'}",
        f"model.mcore_path={tmp / 'tiny_mcore'}",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three runs in order in one launch (tests/dist/multi_run.py); each run's own log."""
    tmp = tmp_path_factory.mktemp("quickstart")
    # the straight run's export is the one tested; an export costs ~11 s (its own process) on 2 cores
    no_export = ["trainer.eval_interval=0", "trainer.export_hf_at_end=false"]
    straight, first_half, second_half = torchrun_cases(
        1,
        [
            train_overrides(tmp, "straight", 4, ["trainer.eval_interval=2"]),
            train_overrides(tmp, "resumed", 2, no_export),
            train_overrides(tmp, "resumed", 4, no_export),
        ],
    )
    return tmp, straight, first_half, second_half


def test_straight_run_trains_and_loss_falls(runs):
    tmp, straight, _, _ = runs
    seen = losses(straight)
    assert sorted(seen) == [1, 2, 3, 4]
    assert seen[4] < seen[1] - 0.3, seen  # lr 3e-3 warmup: the loss falls within 4 steps
    assert "creating the tiny demo model" in straight
    assert (tmp / "tiny_mcore" / "moe_sft_meta.json").is_file()
    assert (tmp / "straight" / "config.yaml").is_file()
    # The data summary: counts and the length histogram, then per-step packing efficiency.
    assert "train data: 1 file(s), 3,000 rows -> 3,000 samples, 128,040 tokens" in straight
    assert "length histogram" in straight and "eval set: 200 samples" in straight
    assert all(m["packing_efficiency"] > 0.95 for m in step_metrics(straight).values())


def test_eval_loss_is_logged_and_falls(runs):
    _, straight, first_half, _ = runs
    evals = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^eval (\d+)/4 loss=(\S+)", straight, re.M)}
    assert sorted(evals) == [2, 4] and evals[4] < evals[2], evals
    assert not re.search(r"^eval \d", first_half, re.M)  # trainer.eval_interval=0: no evaluation


def test_resume_continues_step_count_and_matches_straight_run(runs):
    _, straight, first_half, second_half = runs
    assert sorted(losses(first_half)) == [1, 2]
    assert "resumed from" in second_half and "at step 2" in second_half
    resumed = losses(second_half)
    assert sorted(resumed) == [3, 4]  # the step count continues; steps 1-2 are not redone
    full = losses(straight)
    for step in (1, 2):
        assert losses(first_half)[step] == pytest.approx(full[step], abs=1e-6)
    # Same data position, optimizer moments, Adam step and lr schedule after the reload: the
    # losses agree to the 4 significant digits printed (measured: identical).
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-3), (resumed, full)


def test_checkpoints_are_complete_and_pruned(runs):
    tmp, *_ = runs
    ckpts = tmp / "resumed" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "4"
    names = sorted(p.name for p in ckpts.iterdir())
    # keep_last=2, no .tmp left; hf_side: the config + tokenizer the resume loaded (a step dir's
    # copy, kept apart because pruning removes step dirs)
    assert names == ["hf_side", "latest", "step_0000002", "step_0000004"]
    for step in ("step_0000002", "step_0000004"):
        assert (ckpts / step / "moe_sft_meta.json").is_file()
        assert (ckpts / step / "hf" / "config.json").is_file()


def test_export_loads_with_plain_transformers(runs):
    tmp, *_ = runs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp / "straight" / "hf"
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert (out / "model.safetensors.index.json").is_file()
    assert (out / "generation_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "reverse: a b"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == len(tok)


def test_tensorboard_has_the_training_scalars(runs):
    tmp, *_ = runs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp / "straight" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "moe/load_balancing_loss",
        "data/packing_efficiency",
        "eval/loss",
    ):
        assert tag in tags, tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
