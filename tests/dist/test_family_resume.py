"""A family's own tensors through a checkpoint at one layout and a resume at another (torchrun,
gloo, CPU, fp32). Saved after step 2 at a multi-rank layout, resumed on one rank: step 3 must equal
the straight one-rank run's (tests/dist/test_family_layouts.py's setup).
- gpt-oss at EP2: the attention sinks (TP-sharded `softmax_offset`) and the expert biases
  (SequentialMLP's per-expert keys, split over EP) with their optimizer state.
- Qwen3.5 at TP2 + SP: the Gated DeltaNet's in_proj and conv1d saved as per-part TP shards
  (megatron's split factories), A_log / dt_bias split over TP, the MTP layer, and their Adam state."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from moe_sft.conversion.convert import convert
from tests.dist.launch import REPO, step_metrics, torchrun_cases
from tests.dist.test_family_layouts import REL, STEPS, _overrides, _train, _write_tiny

SAVED_AT = {
    "gpt_oss": ["parallel.expert_model_parallel_size=2"],
    "qwen3_5_moe": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
}


@pytest.fixture(scope="module", params=sorted(SAVED_AT))
def source(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"{request.param}_resume")
    vocab = len(AutoTokenizer.from_pretrained(str(REPO / "recipes/demo/tokenizer")))
    has_mtp = _write_tiny(request.param, tmp / "hf", vocab)
    convert(tmp / "hf", tmp / "mcore")
    return tmp, has_mtp, request.param


def test_a_checkpoint_saved_at_another_layout_resumes_on_one_rank(source):
    saved = _train(
        source,
        "resharded",
        [*SAVED_AT[source[2]], f"trainer.max_steps={STEPS - 1}", f"checkpoint.save_interval={STEPS - 1}"],
    )
    assert sorted(saved) == list(range(1, STEPS))
    # one one-rank launch (tests/dist/multi_run.py): the straight run, then the resume (no overrides:
    # one rank, the same output_dir, so it resumes)
    straight, resumed = (
        step_metrics(log)
        for log in torchrun_cases(1, [_overrides(source, "straight", []), _overrides(source, "resharded", [])])
    )
    assert sorted(straight) == list(range(1, STEPS + 1))
    assert sorted(resumed) == [STEPS]
    keys = ("loss", "grad_norm") + (("mtp_loss",) if source[1] else ())
    for key in keys:
        assert resumed[STEPS][key] == pytest.approx(straight[STEPS][key], rel=REL), (key, straight, resumed)
