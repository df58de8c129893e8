"""The newer families' tiny models train alike at every parallel layout (torchrun, gloo, CPU, fp32).

For each family of NEW_FAMILY_LAYOUTS, its tiny HF model (with an MTP layer in the released layout
where the family has them, trained with a loss weight) is converted, then trained 3 steps of 4
packed micro-batches on one rank and at TP2 + SP, EP2 (expert TP 1), PP2 (the MTP layer on the last
stage) and CP2: the printed loss, MTP loss and grad norm of every step must equal the one-rank
run's within 2e-3 relative (4 printed digits, as tests/dist/test_layouts.py). Every run pads
documents to 4 tokens (what CP2 needs), so all train on the same micro-batches.

A family's two-rank runs share one launch (tests/dist/multi_run.py: start-up, imports and the
process group once, each run with its own layout, model and optimizer); measured equal to separate
launches to the printed digit.
"""

from __future__ import annotations

from functools import partial

import pytest
from transformers import AutoTokenizer

from moe_sft.conversion.convert import convert
from moe_sft.models import registry
from tests.cpu.test_families import _hf_model
from tests.dist.launch import REPO, step_metrics, tiny_run_overrides, torchrun, torchrun_cases
from tests.glm4_moe_mtp import write_tiny_glm4_moe_with_mtp
from tests.qwen3_next_mtp import write_tiny_with_mtp

NEW_FAMILY_LAYOUTS = ["glm4_moe", "minimax_m2", "gpt_oss", "qwen3_5_moe", "gemma4"]
# family -> writer(path, vocab) of its tiny HF checkpoint with MTP layers; others: no MTP layer.
# GLM's expert bias (spread 0.5) steers whole micro-batches away from one EP rank's experts: EP2
# first crashed there (gather_sum of no rows), then deadlocked (that rank's backward skipped the
# all-gather of the routing probs; layers/experts.py keeps them in the graph).
# Qwen3.5's MTP layer (the release's `mtp.*`) is gated full attention after a hybrid stack.
MTP_WRITERS = {
    "glm4_moe": partial(write_tiny_glm4_moe_with_mtp, bias_scale=0.5),
    "qwen3_5_moe": partial(write_tiny_with_mtp, "qwen3_5_moe"),
}

STEPS = 3
REL = 2e-3  # the console prints 4 significant digits
LAYOUTS = {
    "tp2_sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    "ep2_etp1": ["parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    "cp2": ["parallel.context_parallel_size=2"],
}
# Gemma 4's tiny model has one key/value head on its full layer; TP2 needs two on every layer
TINY_OVERRIDES = {"gemma4": {"num_global_key_value_heads": 2}}
# gpt-oss's experts have biases, which megatron-core 0.16.1 allows only at expert TP 1
FAMILY_OVERRIDES = {"gpt_oss": {"tp2_sp": ["parallel.expert_tensor_parallel_size=1"]}}
# Qwen3-Next shares every module with Qwen3.5 but the GDN projections' HF layout (conversion tests);
# Qwen3.5's CP2 runs its Gated DeltaNet layers through the head all-to-all (layers/context_parallel.py).


def _write_tiny(family_name: str, path, vocab: int) -> bool:
    """The family's tiny HF checkpoint in `path`; True when it has an MTP layer."""
    if family_name in MTP_WRITERS:
        MTP_WRITERS[family_name](path, vocab)
        return True
    family = registry.family_by_name(family_name)
    _hf_model(family, family.tiny_hf_config(vocab_size=vocab, **TINY_OVERRIDES.get(family_name, {})), path)
    return False


def _source(tmp, family_name: str):
    """(tmp, has_mtp, family) with the family's tiny model in tmp/hf, converted into tmp/mcore."""
    vocab = len(AutoTokenizer.from_pretrained(str(REPO / "recipes/demo/tokenizer")))
    has_mtp = _write_tiny(family_name, tmp / "hf", vocab)
    convert(tmp / "hf", tmp / "mcore")
    return tmp, has_mtp, family_name


def _overrides(source, name, overrides) -> list[str]:
    tmp, has_mtp, _ = source
    mtp = ["model.mtp_loss_weight=0.3"] if has_mtp else []
    return tiny_run_overrides(tmp, tmp / name, STEPS, "data.pad_documents_to=4", *mtp, *overrides, global_batch_size=4)


def _train(source, name, overrides):
    """One run: on one rank without `overrides`, else on two."""
    proc = torchrun(1 if not overrides else 2, _overrides(source, name, overrides))
    return step_metrics(proc.stdout)


def _train_layouts(source, layouts: dict[str, list[str]]) -> dict[str, dict]:
    """{layout: step metrics}: every layout's run on two ranks, one after another in one launch."""
    logs = torchrun_cases(2, [_overrides(source, name, overrides) for name, overrides in layouts.items()])
    return {name: step_metrics(log) for name, log in zip(layouts, logs)}


# The hybrid stack split into four virtual stages of one layer (GDN, GDN, GDN, gated attention +
# the MTP layer): each chunk must pick its mixer by its global layer number; and plain DP2 with
# the distributed optimizer sharding the GDN parameters' Adam state.
HYBRID_LAYOUTS = {
    "pp2_vpp2": ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"],
    "dp2": ["parallel.tensor_model_parallel_size=1"],  # any override: two ranks, data parallel
}
HYBRID_FAMILIES = ["qwen3_5_moe"]


def _family_layouts(family_name: str) -> dict[str, list[str]]:
    """LAYOUTS with the family's overrides, and HYBRID_LAYOUTS for a hybrid family."""
    layouts = {name: LAYOUTS[name] + FAMILY_OVERRIDES.get(family_name, {}).get(name, []) for name in sorted(LAYOUTS)}
    if family_name in HYBRID_FAMILIES:
        layouts.update({f"hybrid_{name}": HYBRID_LAYOUTS[name] for name in sorted(HYBRID_LAYOUTS)})
    return layouts


@pytest.mark.parametrize("family_name", NEW_FAMILY_LAYOUTS)
def test_layouts_match_one_rank(tmp_path, family_name):
    """Every layout of the family (_family_layouts, all in one two-rank launch) against one rank: each
    layout's every step and key is checked, and every mismatch is reported, not only the first."""
    source = _source(tmp_path, family_name)
    one_rank = _train(source, "one_rank", [])
    assert sorted(one_rank) == list(range(1, STEPS + 1)), one_rank
    keys = ("loss", "grad_norm") + (("mtp_loss",) if source[1] else ())
    mismatches = []
    for layout, metrics in _train_layouts(source, _family_layouts(family_name)).items():
        print(family_name, layout, metrics)
        assert sorted(metrics) == sorted(one_rank), (layout, one_rank, metrics)
        for step in range(1, STEPS + 1):
            for key in keys:
                if metrics[step][key] != pytest.approx(one_rank[step][key], rel=REL):
                    mismatches.append((layout, step, key, one_rank[step][key], metrics[step][key]))
    assert not mismatches, (mismatches, one_rank)
