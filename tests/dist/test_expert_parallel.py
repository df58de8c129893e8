"""EP=2 x DP=2 on two CPU ranks (gloo, allgather dispatcher) trains the quickstart model with the
same losses as one rank.

The allgather dispatcher needs equal shapes, so there micro-batches are padded to pack_length;
the padding is passed to megatron as `padding_mask`, so it is neither routed nor counted in the
aux loss. Before that, padding changed the step-1 grad norm from 6.558 to 7.504 and step 3's loss
from 6.216 to 6.226."""

from __future__ import annotations

import pytest

from tests.dist.launch import losses, torchrun, torchrun_cases


def _overrides(tmp, nproc, extra=(), name=""):
    return [
        "trainer.max_steps=3",
        "trainer.log_interval=1",
        "trainer.export_hf_at_end=false",
        f"trainer.output_dir={tmp / f'run{nproc}{name}'}",
        f"model.hf_path={tmp / 'hf'}",
        f"model.mcore_path={tmp / 'mcore'}",
        *extra,
    ]


def _run(tmp, nproc, extra=(), name=""):
    proc = torchrun(nproc, _overrides(tmp, nproc, extra, name))
    return losses(proc.stdout), proc.stdout + proc.stderr


def _runs(tmp, nproc, runs):
    """[(losses, log)] of `runs` [(extra, name)], one after another in one launch of `nproc` ranks
    (tests/dist/multi_run.py); a log is the run's rank-0 stdout."""
    logs = torchrun_cases(nproc, [_overrides(tmp, nproc, extra, name) for extra, name in runs])
    return [(losses(log), log) for log in logs]


def test_ep2_dp2_losses_match_one_rank(tmp_path):
    """Top-2 of 8 experts at EP2 and 1024-token micro-batches: the static-row permutation
    (kernels/permute.py, its padding 2x), whose padding must change nothing; and with its capacity
    cut to 1x, the steps whose routing exceeds it run again and train the same (that run also
    reduce-scatters the combine in the model's dtype, `model.moe_combine_dtype=bf16`: fp32 on CPU,
    and dispatches each MoE layer in 3 token chunks, `model.moe_dispatch_chunks=3`, each with its
    own capacity)."""
    one, _ = _run(tmp_path, 1)
    # Capacity 1x (EP3+ runs are capped at 2x): see below; both EP2 runs share one launch
    capped_run = [
        "parallel.expert_model_parallel_size=2",
        "model.moe_static_rows_capacity=1",
        "model.moe_combine_dtype=bf16",
        "model.moe_dispatch_chunks=3",
    ]
    (two, log), (capped, capped_log) = _runs(
        tmp_path, 2, [(["parallel.expert_model_parallel_size=2"], ""), (capped_run, "c")]
    )
    assert "2 MoE layers permute a static row count" in log
    assert sorted(two) == [1, 2, 3]
    for step in (1, 2, 3):  # printed to 4 significant digits
        assert two[step] == pytest.approx(one[step], rel=2e-4), (one, two)
    # Capacity 1x (EP3+ runs are capped at 2x): one of the two ranks gets more than its expected rows
    # in nearly every layer, so the capped permutation cuts rows, and every step must run again with
    # exact rows (trainer/row_capacity.py) and still train as one rank does.
    log = capped_log
    assert "the allgather's combine reduce-scatters in bf16" in log
    assert "2 MoE layers dispatch in 3 token chunks" in log
    reruns = [line for line in log.splitlines() if "runs again with exact row counts" in line]
    assert [line.split("step ")[1].split(":")[0] for line in reruns] == ["1", "2", "3"], log[-3000:]
    assert "rows above the capacity" in reruns[0]
    for step in (1, 2, 3):
        assert capped[step] == pytest.approx(one[step], rel=2e-4), (one, capped)


def test_a_step_run_again_updates_the_expert_bias_once(tmp_path):
    """GLM-4.5's tiny model (sigmoid routing with the aux-loss-free expert bias, an MTP layer) at EP2
    with the static rows' capacity at 1x, so that steps run again (trainer/row_capacity.py).
    megatron updates the expert bias from the step's token counts after each backward; the re-run
    must start from the bias as it was, or the bias moves twice per step. Loss, grad norm and the
    bias drift (TensorBoard's float32 values) equal those of the same layout without re-runs."""
    from transformers import AutoTokenizer

    from moe_sft.conversion.convert import convert
    from tests.dist.launch import REPO
    from tests.glm4_moe_mtp import write_tiny_glm4_moe_with_mtp
    from tools.plot_metrics import read_scalars

    vocab = len(AutoTokenizer.from_pretrained(str(REPO / "recipes/demo/tokenizer")))
    write_tiny_glm4_moe_with_mtp(tmp_path / "hf", vocab)
    convert(tmp_path / "hf", tmp_path / "mcore")
    glm = [
        "parallel.expert_model_parallel_size=2",
        "model.create_tiny_if_missing=false",
        "model.moe_router_bias_update_rate=0.01",  # a visible move per step
        "model.mtp_loss_weight=0.3",
    ]
    runs = {}
    capacities = (("plain", 2), ("capped", 1))
    launch = _runs(tmp_path, 2, [([*glm, f"model.moe_static_rows_capacity={c}"], name) for name, c in capacities])
    for (name, _), (_, log) in zip(capacities, launch):
        reruns = log.count("runs again with exact row counts")
        scalars = read_scalars(tmp_path / f"run2{name}")
        runs[name] = (reruns, {tag: dict(scalars[tag]) for tag in ("train/loss", "train/grad_norm", "moe/bias_drift")})
    assert runs["plain"][0] == 0 and runs["capped"][0] == 3, runs
    plain, capped = runs["plain"][1], runs["capped"][1]
    assert plain["moe/bias_drift"][1] > 0
    for tag, by_step in plain.items():
        for step in (1, 2, 3):
            assert capped[tag][step] == pytest.approx(by_step[step], rel=1e-5), (tag, plain, capped)
