"""Every parallel layout computes the same training step as one rank (torchrun, gloo, CPU, fp32).

A 4-layer tiny Qwen3-MoE (8 experts, top-2; demo tokenizer and data) trains 3 steps of 4 packed
micro-batches at each layout; the printed loss and grad norm (4 significant digits) of every step
must equal the one-rank run's within 2e-3 relative. Steps 2 and 3 also check that the optimizer
updates were the same. The router aux loss stays on: its gradient crosses the layouts too.

Then resharding: a checkpoint saved at one layout resumes at another, also across the EP boundary
(one optimizer ↔ dense + expert optimizers), with the losses of the straight one-rank run.
"""

from __future__ import annotations

import pytest

from tests.dist.launch import make_tiny_model, step_metrics, torchrun

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


def _train(tmp, name, nproc, overrides, max_steps=STEPS, extra=()):
    proc = torchrun(
        nproc,
        [
            f"trainer.max_steps={max_steps}",
            "trainer.log_interval=1",
            "trainer.global_batch_size=4",
            "trainer.export_hf_at_end=false",
            f"trainer.output_dir={tmp / name}",
            f"model.hf_path={tmp / 'hf'}",
            f"model.mcore_path={tmp / 'mcore'}",
            "model.create_tiny_if_missing=false",
            *overrides,
            *extra,
        ],
    )
    return step_metrics(proc.stdout)


@pytest.fixture(scope="module")
def one_rank(model_dirs):
    return _train(model_dirs, "one_rank", 1, [], max_steps=STEPS + 1)


def _assert_same(reference, other, steps, keys=("loss", "grad_norm")):
    for step in steps:
        for key in keys:
            assert other[step][key] == pytest.approx(reference[step][key], rel=REL), (step, key, reference, other)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_one_rank(model_dirs, one_rank, layout):
    nproc, overrides = LAYOUTS[layout]
    metrics = _train(model_dirs, layout, nproc, overrides)
    print(layout, {s: (m["loss"], m["grad_norm"]) for s, m in metrics.items()})
    assert sorted(metrics) == list(range(1, STEPS + 1))
    _assert_same(one_rank, metrics, range(1, STEPS + 1))


def test_checkpoint_saved_at_tp2_pp2_resumes_at_ep2(model_dirs, one_rank):
    """Save after 2 steps on 4 ranks (TP2·PP2, one optimizer), resume on 2 ranks with EP2 (megatron
    splits the optimizer into dense + expert) for steps 3-4: another world size, another TP/PP and
    across the EP boundary."""
    first = _train(model_dirs, "reshard", 4, TP2_PP2, max_steps=2, extra=["checkpoint.save_interval=2"])
    second = _train(model_dirs, "reshard", 2, ["parallel.expert_model_parallel_size=2"], max_steps=STEPS + 1)
    print("reshard", first, second)
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    _assert_same(one_rank, first, [1, 2])
    _assert_same(one_rank, second, [3, 4])


def test_checkpoint_saved_at_ep2_resumes_at_tp2(model_dirs, one_rank):
    """The other direction across the EP boundary: dense + expert optimizers saved, one loaded."""
    first = _train(
        model_dirs,
        "reshard_ep",
        2,
        ["parallel.expert_model_parallel_size=2"],
        max_steps=2,
        extra=["checkpoint.save_interval=2"],
    )
    second = _train(model_dirs, "reshard_ep", 2, LAYOUTS["tp2_sp"][1], max_steps=STEPS + 1)
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    _assert_same(one_rank, second, [3, 4])


OVERLAP_RECOMPUTE = [
    "parallel.overlap_grad_reduce=true",
    "parallel.overlap_param_gather=true",
    "model.recompute_granularity=selective",
    "model.recompute_modules=[core_attn,moe,layernorm]",
]


def test_overlapped_dp2_with_selective_recompute_matches_one_rank_and_resumes(model_dirs, one_rank):
    """DP2 with grad-reduce and param-gather overlap (megatron's bucketed async collectives) and
    selective recompute of attention, MoE and norms: the same steps as one rank. With param-gather
    overlap the updated parameters arrive only in the next forward, so the checkpoint saved after
    step 3 is stale unless the trainer syncs them first: resuming from it must give step 4."""
    first = _train(model_dirs, "overlap", 2, OVERLAP_RECOMPUTE)
    second = _train(model_dirs, "overlap", 2, OVERLAP_RECOMPUTE, max_steps=STEPS + 1)
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
