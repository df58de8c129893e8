"""Every parallel layout computes the same training step as one rank (torchrun, gloo, CPU, fp32).

A 4-layer tiny Qwen3-MoE (8 experts, top-2; demo tokenizer and data) trains 3 steps of 4 packed
micro-batches at each layout; the printed loss and grad norm (4 significant digits) of every step
must equal the one-rank run's within 2e-3 relative. Steps 2 and 3 also check that the optimizer
updates were the same. The router aux loss stays on: its gradient crosses the layouts too.

Then resharding: a checkpoint saved at one layout resumes at another, also across the EP boundary
(one optimizer ↔ dense + expert optimizers), with the losses of the straight one-rank run.

Runs of one world size share a launch (tests/dist/multi_run.py: start-up, imports and the process
group once, each run with its own layout, model and optimizer).
"""

from __future__ import annotations

import pytest

from tests.dist.launch import make_tiny_model, step_metrics, tiny_run_overrides, torchrun_cases

STEPS = 3
REL = 2e-3  # the console prints 4 significant digits

# name → (ranks, overrides). Also measured equal to one rank, not run in CI to keep the suite
# short: dp2, pp2, pp2_ep2_dp2 (4 ranks); EP2 x DP2 is tests/dist/test_expert_parallel.py.
TP2_PP2 = [
    "parallel.tensor_model_parallel_size=2",
    "parallel.sequence_parallel=true",
    "parallel.pipeline_model_parallel_size=2",
]
LAYOUTS = {
    "tp2_sp": (2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    "pp2_vpp2": (2, ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"]),
    "pp2_uneven_3_1": (2, ["parallel.pipeline_model_parallel_size=2", "parallel.num_layers_in_first_pipeline_stage=3"]),
    "tp2_ep2_etp1": (
        2,
        [
            "parallel.tensor_model_parallel_size=2",
            "parallel.sequence_parallel=true",
            "parallel.expert_model_parallel_size=2",
            "parallel.expert_tensor_parallel_size=1",
        ],
    ),
    "tp2_pp2": (4, TP2_PP2),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("layouts"), num_hidden_layers=4)


def _overrides(tmp, name, overrides, max_steps=STEPS) -> list[str]:
    return tiny_run_overrides(tmp, tmp / name, max_steps, *overrides, global_batch_size=4)


def _train(tmp, nproc, runs) -> dict[str, dict]:
    """{key: step metrics} of `runs` [(key, output dir name, overrides, max_steps)], one after another
    in one launch of `nproc` ranks (tests/dist/multi_run.py): a run that resumes an output dir
    follows the run that saved there."""
    logs = torchrun_cases(nproc, [_overrides(tmp, name, overrides, steps) for _, name, overrides, steps in runs])
    return {key: step_metrics(log) for (key, *_), log in zip(runs, logs)}


def _assert_same(reference, other, steps, keys=("loss", "grad_norm")):
    for step in steps:
        for key in keys:
            assert other[step][key] == pytest.approx(reference[step][key], rel=REL), (step, key, reference, other)


OVERLAP_RECOMPUTE = [
    "parallel.overlap_grad_reduce=true",
    "parallel.overlap_param_gather=true",
    "model.recompute_granularity=selective",
    "model.recompute_modules=[core_attn,moe,layernorm]",
]


EP2 = ["parallel.expert_model_parallel_size=2"]
SAVE_AT_2 = ["checkpoint.save_interval=2"]


def test_layouts_match_one_rank_and_checkpoints_reshard(model_dirs):
    """Every layout, the resharding checkpoints and the overlapped DP2 run, in three launches: four
    ranks, two ranks (each resume right after the run whose checkpoint it loads), one rank."""
    runs = _train(
        model_dirs,
        4,
        [(name, name, overrides, STEPS) for name, (nproc, overrides) in sorted(LAYOUTS.items()) if nproc == 4]
        + [("reshard_first", "reshard", [*TP2_PP2, *SAVE_AT_2], 2)],
    )
    runs.update(
        _train(
            model_dirs,
            2,
            [(name, name, overrides, STEPS) for name, (nproc, overrides) in sorted(LAYOUTS.items()) if nproc == 2]
            + [
                ("reshard_second", "reshard", EP2, STEPS + 1),
                ("reshard_ep_first", "reshard_ep", [*EP2, *SAVE_AT_2], 2),
                ("reshard_ep_second", "reshard_ep", LAYOUTS["tp2_sp"][1], STEPS + 1),
                ("overlap_first", "overlap", OVERLAP_RECOMPUTE, STEPS),
                ("overlap_second", "overlap", OVERLAP_RECOMPUTE, STEPS + 1),
            ],
        )
    )
    one_rank = _train(model_dirs, 1, [("one_rank", "one_rank", [], STEPS + 1)])["one_rank"]
    for layout in sorted(LAYOUTS):
        _check_layout(one_rank, layout, runs[layout])
    _check_saved_at_tp2_pp2_resumes_at_ep2(one_rank, runs["reshard_first"], runs["reshard_second"])
    _check_saved_at_ep2_resumes_at_tp2(one_rank, runs["reshard_ep_first"], runs["reshard_ep_second"])
    _check_overlapped_dp2(model_dirs, one_rank, runs["overlap_first"], runs["overlap_second"])


def _check_layout(one_rank, layout, metrics):
    print(layout, {s: (m["loss"], m["grad_norm"]) for s, m in metrics.items()})
    assert sorted(metrics) == list(range(1, STEPS + 1)), layout
    _assert_same(one_rank, metrics, range(1, STEPS + 1))


def _check_saved_at_tp2_pp2_resumes_at_ep2(one_rank, first, second):
    """Save after 2 steps on 4 ranks (TP2·PP2, one optimizer), resume on 2 ranks with EP2 (megatron
    splits the optimizer into dense + expert) for steps 3-4: another world size, another TP/PP and
    across the EP boundary."""
    print("reshard", first, second)
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    _assert_same(one_rank, first, [1, 2])
    _assert_same(one_rank, second, [3, 4])


def _check_saved_at_ep2_resumes_at_tp2(one_rank, first, second):
    """The other direction across the EP boundary: dense + expert optimizers saved, one loaded."""
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    _assert_same(one_rank, second, [3, 4])


def _check_overlapped_dp2(model_dirs, one_rank, first, second):
    """DP2 with grad-reduce and param-gather overlap (megatron's bucketed async collectives) and
    selective recompute of attention, MoE and norms: the same steps as one rank. With param-gather
    overlap the updated parameters arrive only in the next forward, so the checkpoint saved after
    step 3 is stale unless the trainer syncs them first: resuming from it must give step 4."""
    assert sorted(first) == list(range(1, STEPS + 1)) and sorted(second) == [STEPS + 1]
    _assert_same(one_rank, first, range(1, STEPS + 1))
    _assert_same(one_rank, second, [STEPS + 1])
    # The saved weights themselves (what export reads), against the one-rank run's final ones.
    ours, reference = (_final_weights(model_dirs / name) for name in ("overlap", "one_rank"))
    worst = max(((ours[k] - v).abs().max() / v.abs().max()).item() for k, v in reference.items())
    assert worst < 1e-4, worst


def _final_weights(run_dir) -> dict:
    import torch

    from moe_sft.conversion.export import load_model_from_checkpoint
    from moe_sft.trainer.checkpoint import step_dir

    model = load_model_from_checkpoint(step_dir(run_dir / "checkpoints", STEPS + 1))
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()
    }
