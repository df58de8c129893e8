"""Bug classes megatron-core fixed after 0.16.1 (or has open), checked against moe-sft's stack:
the features they live in turned on together, every layout compared with one rank (torchrun,
gloo, CPU, fp32). Verdicts per upstream report: docs/layouts.md, "Upstream bug classes".

A tiny DeepSeek-V3 with one MTP layer (MLA, sigmoid group-limited routing with the aux-loss-free
expert bias, a dense first layer) trains 3 steps of 4 packed micro-batches with the sequence-level
aux loss (coefficient 0.01), the expert bias moving 0.01 per step and the MTP loss at weight 0.3.
Documents are padded to 4 tokens everywhere (what CP2 needs, so that every run packs the same
micro-batches); the padding a layout adds (the allgather dispatcher pads micro-batches to one
length) must leave no trace:
- CP2 with EP2 (the EP group spans the CP ranks) and full recompute: the loss and the MTP loss
  normalised over ranks holding unequal token counts, the MTP labels rolled across CP ranks,
  expert-bias token counts and aux losses with padding, aux losses logged once under recompute;
- TP2 + SP with EP2 and expert TP 1: aux-loss gradient scaling at TP > 1, router token counts under
  SP with a padding mask, the grad norm of experts whose EP group crosses the TP group.
TensorBoard's float32 loss, MTP loss, grad norm, sequence aux loss and per-layer bias drift of
every step must equal the one-rank run's (relative differences measured: docs/layouts.md).
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from moe_sft.conversion.convert import convert
from tests.deepseek_mtp import write_tiny_deepseek_with_mtp
from tests.dist.launch import REPO, step_metrics, tiny_run_overrides, torchrun_cases

STEPS = 3
FEATURES = [
    "model.moe_router_load_balancing_type=seq_aux_loss",
    "model.moe_aux_loss_coeff=0.01",
    "model.moe_router_bias_update_rate=0.01",
    "model.mtp_loss_weight=0.3",
    "data.pad_documents_to=4",  # CP2's document multiple everywhere: every run packs the same micro-batches
]
LAYOUTS = {
    "cp2_ep2_full_recompute": [
        "parallel.context_parallel_size=2",
        "parallel.expert_model_parallel_size=2",
        "model.recompute_granularity=full",
        "model.recompute_method=uniform",
        "model.recompute_num_layers=1",
    ],
    "tp2_sp_ep2_etp1": [
        "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        "parallel.expert_model_parallel_size=2",
        "parallel.expert_tensor_parallel_size=1",
    ],
}
# Relative tolerances on the float32 TensorBoard values: fp32 reduction order moves them by at
# most 1e-6 here; the MTP router counting padding moved the aux loss by 3e-4, the grad norm by 7e-6.
TOLERANCES = {
    "train/loss": 1e-6,
    "train/mtp_loss": 1e-6,
    "train/grad_norm": 3e-6,
    "moe/seq_load_balancing_loss": 1e-5,
}
BIAS_DRIFT = "bias_drift_l2"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("upstream_bugs")
    vocab = len(AutoTokenizer.from_pretrained(str(REPO / "recipes/demo/tokenizer")))
    write_tiny_deepseek_with_mtp(tmp / "hf", vocab)
    convert(tmp / "hf", tmp / "mcore")
    return tmp


def _train(tmp, nproc, runs: dict[str, list[str]]) -> dict[str, dict[str, dict[int, float]]]:
    """{name: TensorBoard scalars} of `runs`, one after another in one launch of `nproc` ranks
    (tests/dist/multi_run.py)."""
    from tools.plot_metrics import read_scalars

    logs = torchrun_cases(
        nproc,
        [
            tiny_run_overrides(tmp, tmp / name, STEPS, *FEATURES, *overrides, global_batch_size=4)
            for name, overrides in runs.items()
        ],
    )
    for name, log in zip(runs, logs):
        assert sorted(step_metrics(log)) == list(range(1, STEPS + 1)), (name, log[-3000:])
    return {name: {tag: dict(points) for tag, points in read_scalars(tmp / name).items()} for name in runs}


def _compared_tags(scalars) -> dict[str, float]:
    drifts = {tag: 1e-6 for tag in scalars if tag.endswith(BIAS_DRIFT)}
    return {**TOLERANCES, **drifts}


def test_features_at_layouts_match_one_rank(source):
    """Every layout of LAYOUTS (one two-rank launch) against the one-rank run."""
    one_rank = _train(source, 1, {"one_rank": []})["one_rank"]
    runs = _train(source, 2, {layout: LAYOUTS[layout] for layout in sorted(LAYOUTS)})
    for layout in sorted(LAYOUTS):
        _check_layout(layout, runs[layout], one_rank)


def _check_layout(layout, other, one_rank):
    tags = _compared_tags(one_rank)
    assert len(tags) == len(TOLERANCES) + 2, sorted(one_rank)  # the MoE layer and the MTP layer drift
    worst = {}
    for tag in tags:
        diffs = [abs(other[tag][s] - v) / abs(v) for s, v in one_rank[tag].items() if v]
        assert sorted(other[tag]) == list(range(1, STEPS + 1)), (tag, other[tag])
        worst[tag] = max(diffs)
    print(layout, {tag: f"{d:.1e}" for tag, d in worst.items()})
    assert all(worst[tag] <= rel for tag, rel in tags.items()), {tag: (worst[tag], rel) for tag, rel in tags.items()}
    assert one_rank["moe/bias_drift"][1] > 0
