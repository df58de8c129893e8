"""gpt-oss's own tensors through a checkpoint at one layout and a resume at another (torchrun, gloo,
CPU, fp32): the attention sinks (TP-sharded `softmax_offset`) and the expert biases (SequentialMLP's
per-expert keys, split over EP) with their optimizer state. Saved after step 2 at EP2, resumed on
one rank: step 3 must equal the straight one-rank run's (tests/dist/test_family_layouts.py's setup)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from moe_sft.conversion.convert import convert
from tests.dist.launch import REPO
from tests.dist.test_family_layouts import REL, STEPS, _train, _write_tiny


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss_resume")
    vocab = len(AutoTokenizer.from_pretrained(str(REPO / "recipes/demo/tokenizer")))
    _write_tiny("gpt_oss", tmp / "hf", vocab)
    convert(tmp / "hf", tmp / "mcore")
    return tmp, False, "gpt_oss"


def test_a_checkpoint_saved_at_ep2_resumes_on_one_rank(source):
    straight = _train(source, "straight", [])
    saved = _train(
        source,
        "resharded",
        [
            "parallel.expert_model_parallel_size=2",
            f"trainer.max_steps={STEPS - 1}",
            f"checkpoint.save_interval={STEPS - 1}",
        ],
    )
    assert sorted(saved) == list(range(1, STEPS))
    resumed = _train(source, "resharded", [])  # no overrides: one rank, the same output_dir, so it resumes
    assert sorted(resumed) == [STEPS]
    for key in ("loss", "grad_norm"):
        assert resumed[STEPS][key] == pytest.approx(straight[STEPS][key], rel=REL), (key, straight, resumed)
