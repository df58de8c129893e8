"""DeepSeek-V3 with a multi-token-prediction layer through the trainer (torchrun, gloo, CPU):
trained MTP gives the same losses on one rank, on two pipeline stages (MTP sits on the last
stage with its own tied copy of the embedding) and at TP2 with sequence parallelism, a frozen MTP
layer is exported unchanged, and the export always carries the MTP tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from moe_sft.conversion.convert import convert
from tests.cpu.test_families import _all_tensors
from tests.deepseek_mtp import write_tiny_deepseek_with_mtp
from tests.dist.launch import REPO, step_metrics, torchrun_cases

MTP_PREFIX = "model.layers.2."  # the tiny config has 2 decoder layers, then the MTP layer


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp_train")
    vocab = len(AutoTokenizer.from_pretrained(str(REPO / "recipes/demo/tokenizer")))
    write_tiny_deepseek_with_mtp(tmp / "hf", vocab)
    convert(tmp / "hf", tmp / "mcore")
    return tmp


def _train(tmp, nproc, runs: dict[str, list[str]]) -> dict[str, tuple]:
    """{name: (step metrics, log)} of `runs`, one after another in one launch of `nproc` ranks
    (tests/dist/multi_run.py)."""
    logs = torchrun_cases(
        nproc,
        [
            [
                "trainer.max_steps=3",
                "trainer.log_interval=1",
                f"trainer.output_dir={tmp / name}",
                f"model.hf_path={tmp / 'hf'}",
                f"model.mcore_path={tmp / 'mcore'}",
                "model.create_tiny_if_missing=false",
                "model.mtp_loss_weight=0.3",
                *extra,
            ]
            for name, extra in runs.items()
        ],
    )
    return {name: (step_metrics(log), log) for name, log in zip(runs, logs)}


@pytest.fixture(scope="module")
def trained(source):
    """Two launches: one rank (trained and frozen MTP), two ranks (PP2, TP2 + SP)."""
    runs = _train(source, 1, {"one": [], "frozen": ["model.freeze_mtp=true"]})
    no_export = "trainer.export_hf_at_end=false"
    layouts = {
        "pp2": ["parallel.pipeline_model_parallel_size=2", no_export],
        # sequence parallel: both heads' rows are picked from hidden states gathered across TP
        "tp2_sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", no_export],
    }
    return {**runs, **_train(source, 2, layouts)}


@pytest.mark.parametrize("layout", ["pp2", "tp2_sp"])
def test_mtp_trains_and_other_layouts_match_one_rank(trained, layout):
    (one, log), (other, _) = trained["one"], trained[layout]
    assert "multi-token prediction: 1 layer(s), trained with loss weight 0.3" in log
    assert sorted(one) == sorted(other) == [1, 2, 3]
    for step in (1, 2, 3):
        assert "mtp_loss" in one[step] and "mtp_loss" in other[step]
        for key in ("loss", "mtp_loss", "grad_norm"):  # printed to 4 significant digits
            assert other[step][key] == pytest.approx(one[step][key], rel=2e-3), (key, one, other)
    assert one[3]["mtp_loss"] < one[1]["mtp_loss"]


def test_trained_mtp_layer_is_exported_with_its_updates(source, trained):
    before, after = _all_tensors(source / "hf"), _all_tensors(source / "one" / "hf")
    assert set(after) == set(before)
    assert not torch.equal(before[MTP_PREFIX + "eh_proj.weight"], after[MTP_PREFIX + "eh_proj.weight"])
    # the MTP layer's embedding / head copies follow the (trained) main ones
    assert torch.equal(after[MTP_PREFIX + "embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert torch.equal(after[MTP_PREFIX + "shared_head.head.weight"], after["lm_head.weight"])


def test_frozen_mtp_layer_is_exported_unchanged(source, trained):
    metrics, log = trained["frozen"]
    assert "frozen (exported unchanged)" in log and "mtp_loss" not in metrics[1]
    before, after = _all_tensors(source / "hf"), _all_tensors(source / "frozen" / "hf")
    assert set(after) == set(before)
    copies = (MTP_PREFIX + "embed_tokens.weight", MTP_PREFIX + "shared_head.head.weight")
    mtp = [k for k in before if k.startswith(MTP_PREFIX) and k not in copies]
    assert len(mtp) > 20 and all(torch.equal(before[k], after[k].to(before[k].dtype)) for k in mtp)
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])  # the rest trained
