"""Context parallel trains like one rank (torchrun, gloo, CPU, fp32).

The 4-layer tiny Qwen3-MoE of tests/dist/test_layouts.py (8 experts top-2, router aux loss on)
trains 3 steps of 4 packed micro-batches at CP2 and at CP2 x EP2 (both on 2 ranks; with EP the
allgather dispatcher needs one shape, so the step pads every micro-batch to a common length);
the loss, grad norm and router load-balancing loss of every step must equal the one-rank run's:
within 2e-3 relative on the printed 4 digits, and within 1e-5 on the float32 TensorBoard scalars
(measured: <= 1.1e-7). The demo documents have odd lengths, so most of them get CP padding.
The loader pads each document to 2*CP and packs the padded lengths; the one-rank reference sets
data.pad_documents_to=4 so that it trains on the same micro-batches.

Also measured equal to one rank, not run here to keep the file under ~3 minutes on 2 cores:
CP2 x TP2 + SP on 4 ranks (2.4 minutes alone); it is in benchmarks/gpu/layout_matrix.sh.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.launch import make_tiny_model, step_metrics, tiny_run_overrides, torchrun_cases

STEPS = 3
REL = 2e-3  # the console prints 4 significant digits
TB_REL = 1e-5  # float32 TensorBoard scalars
TAGS = ("train/loss", "train/grad_norm", "moe/load_balancing_loss")

LAYOUTS = {
    "cp2": (2, ["parallel.context_parallel_size=2"]),
    "cp2_ep2": (2, ["parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=2"]),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("context_parallel"), num_hidden_layers=4)


def _tensorboard(run: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in TAGS}


def _overrides(tmp, name, overrides) -> list[str]:
    return tiny_run_overrides(tmp, tmp / name, STEPS, *overrides, global_batch_size=4)


def _train(tmp, nproc, runs: dict[str, list[str]]) -> dict[str, tuple]:
    """{name: (printed, TensorBoard, log)} of `runs`, one after another in one launch of `nproc`
    ranks (tests/dist/multi_run.py)."""
    logs = torchrun_cases(nproc, [_overrides(tmp, name, overrides) for name, overrides in runs.items()])
    return {name: (step_metrics(log), _tensorboard(tmp / name), log) for name, log in zip(runs, logs)}


def test_context_parallel_matches_one_rank(model_dirs):
    """Every layout of LAYOUTS (one two-rank launch) against the one-rank run."""
    one_rank = _train(model_dirs, 1, {"one_rank": ["data.pad_documents_to=4"]})["one_rank"]
    assert {nproc for nproc, _ in LAYOUTS.values()} == {2}
    runs = _train(model_dirs, 2, {layout: overrides for layout, (_, overrides) in sorted(LAYOUTS.items())})
    for layout in sorted(LAYOUTS):
        _check_layout(layout, runs[layout], one_rank)


def _check_layout(layout, run, one_rank):
    printed, tb, log = run
    ref_printed, ref_tb, _ = one_rank
    assert "cp=2" in log  # the startup layout line
    print(layout, {s: (m["loss"], m["grad_norm"]) for s, m in printed.items()})
    assert sorted(printed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "load_balancing_loss"):
            assert printed[step][key] == pytest.approx(ref_printed[step][key], rel=REL), (step, key)
        for tag in TAGS:
            worst = abs(tb[tag][step] - ref_tb[tag][step]) / abs(ref_tb[tag][step])
            print(
                f"{layout} step {step} {tag}: one rank {ref_tb[tag][step]:.9g} cp {tb[tag][step]:.9g} rel {worst:.1e}"
            )
            assert worst <= TB_REL, (step, tag, ref_tb[tag][step], tb[tag][step])
