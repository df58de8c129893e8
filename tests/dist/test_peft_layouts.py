"""LoRA and DoRA train alike at every parallel layout (torchrun, gloo, CPU, fp32).

A 4-layer tiny GLM-4.5 (the DeepSeek-V3 MoE layout: a dense first layer, then 8 routed experts
top-2 beside a shared expert; GQA attention with q/k/v biases; expert bias on) gets LoRA rank 8
on every linear (peft.target_modules=[all_linear]: linear_qkv as q/k/v factors, linear_proj, the
dense MLP, the shared experts and the routed experts) and trains 3 steps of 4 packed
micro-batches at a constant lr of 3e-3 (step 1 is the base's loss: B starts at zero; steps 2-3
then compare the optimizer's updates of the adapters too). At each layout the printed loss and
grad norm (4 digits) must equal the one-rank run's within 2e-3 relative, the float32 TensorBoard
scalars within 1e-5. Every run pads documents to 4 tokens (what CP2 needs), so all of them train
on the same micro-batches.

Launches serve two purposes where they can: a layout run saves its adapters after step 2 and
another layout resumes them for steps 3-4 (TP2+SP → EP2, PP2+VPP2 → one rank): that checks the
resumed layout and the resharding of an adapters-only checkpoint (global keys) at once. The
TP2+SP checkpoint is also checked to hold the adapters and their optimizer state only. Runs of one
world size share a launch (tests/dist/multi_run.py: start-up, imports and the process group once,
each run with its own layout, model and optimizer); a resume runs in a launch after the one of the
run it resumes, whose TensorBoard scalars are read in between.
DoRA (attention, dense MLP and shared experts: peft has no DoRA on fused experts) at TP2+SP
checks the row norm of the row-parallel linear_proj/linear_fc2, reduced over TP; a shared
expert A factor (peft.share_expert_factor=a) at EP2 checks its gradient sum over the EP ranks.
GLM-4.5 rather than DeepSeek-V3: megatron 0.16.1's MLA is not exact at TP > 1 even without
adapters (docs/layouts.md, "LoRA / DoRA"). Measured diffs and runtime: docs/layouts.md.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from moe_sft.conversion.convert import convert
from moe_sft.models import registry
from tests.cpu.test_families import _hf_model
from tests.dist.launch import REPO, step_metrics, tiny_run_overrides, torchrun_cases

STEPS = 3
REL = 2e-3  # the console prints 4 significant digits
TB_REL = 1e-5  # float32 TensorBoard scalars
TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm"}
SP = "parallel.sequence_parallel=true"
TP2 = "parallel.tensor_model_parallel_size=2"
EP2 = "parallel.expert_model_parallel_size=2"
LORA = ["peft.method=lora", "peft.rank=8", "peft.target_modules=[all_linear]"]
DORA = ["peft.method=dora", "peft.rank=8", "peft.target_modules=[attention,dense_mlp,shared_experts]"]
SHARE_A = [*LORA, "peft.share_expert_factor=a"]
SAVE_AT_2 = ["checkpoint.save_interval=2", "checkpoint.save_at_end=false"]

# name → (ranks, overrides) of a LoRA run of steps 1-3 against the one-rank LoRA run. DP2 with the
# distributed optimizer (the default) runs in every EP2 launch below: the dense part is DP2 there.
# Also measured equal, not run here (time): dp2 alone, TP1 with ETP2 (docs/layouts.md).
LAYOUTS = {
    "tp2_etp2": (2, [TP2, SP, "parallel.expert_tensor_parallel_size=2"]),
    "cp2": (2, ["parallel.context_parallel_size=2"]),
    "tp2_ep2_etp1": (2, [TP2, SP, EP2, "parallel.expert_tensor_parallel_size=1"]),
    "tp2_pp2": (4, [TP2, SP, "parallel.pipeline_model_parallel_size=2"]),
}
# name → (ranks, overrides, what resumes its step-2 adapters for steps 3-4: (ranks, overrides)).
RESHARDED = {
    "tp2_sp": (2, [TP2, SP], (2, [EP2])),
    "pp2_vpp2": (
        2,
        ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"],
        (1, []),
    ),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peft_layouts")
    vocab = len(AutoTokenizer.from_pretrained(str(REPO / "recipes/demo/tokenizer")))
    family = registry.family_by_name("glm4_moe")
    _hf_model(family, family.tiny_hf_config(vocab_size=vocab, num_hidden_layers=4), tmp / "hf")
    convert(tmp / "hf", tmp / "mcore")
    return tmp


def _tensorboard(run) -> dict[str, dict[int, float]]:
    """The float32 scalars; a resumed run's steps replace the ones its first run logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {key: {e.step: e.value for e in acc.Scalars(tag)} for key, tag in TAGS.items()}


def _overrides(tmp, name, overrides, max_steps=STEPS) -> list[str]:
    schedule = ("optimizer.lr=3.0e-3", "optimizer.lr_warmup_steps=0", "optimizer.lr_decay_style=constant")
    return tiny_run_overrides(
        tmp, tmp / name, max_steps, "data.pad_documents_to=4", *schedule, *overrides, global_batch_size=4
    )


def _train(tmp, nproc, runs) -> dict[str, dict]:
    """{name: run} of `runs` {name: overrides | (overrides, max_steps)} (output dir tmp/name), one
    after another in one launch of `nproc` ranks (tests/dist/multi_run.py). A run's TensorBoard is
    read once the launch ends: a run that resumes another's output dir runs in a later launch."""
    runs = {name: spec if isinstance(spec, tuple) else (spec, STEPS) for name, spec in runs.items()}
    logs = torchrun_cases(nproc, [_overrides(tmp, name, ov, steps) for name, (ov, steps) in runs.items()])
    return {
        name: {"printed": step_metrics(log), "tb": _tensorboard(tmp / name), "log": log}
        for name, log in zip(runs, logs)
    }


def _assert_same(reference, other, steps) -> dict[str, float]:
    """Max relative diff per metric over `steps` (TensorBoard's float32 values)."""
    worst = {}
    for key in TAGS:
        for step in steps:
            ref, got = reference["printed"][step][key], other["printed"][step][key]
            assert got == pytest.approx(ref, rel=REL), (step, key, reference["printed"], other["printed"])
        diffs = [abs(other["tb"][key][s] - reference["tb"][key][s]) / abs(reference["tb"][key][s]) for s in steps]
        worst[key] = max(diffs)
    print({k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) <= TB_REL, worst
    return worst


COVERAGE = (
    "peft coverage: LoRA r8 on: attention q/k/v/o 4/4 layers, dense MLP fc1/fc2 1/1 layer, "
    "shared expert fc1/fc2 3/3 layers, routed experts fc1/fc2 3/3 layers x 8 experts"
)


def _coverage(log: str) -> str:
    return next(line[line.index("peft coverage:") :] for line in log.splitlines() if "peft coverage:" in line)


def _checkpoint_tensors(step_dir) -> dict[str, int]:
    """{key: elements} of the tensors in a dist checkpoint, from its metadata."""
    from math import prod

    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return {k: prod(v.size) for k, v in meta.items() if hasattr(v, "size")}


def _dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_lora_layouts_match_one_rank_and_resume_at_another(source):
    """Every layout of LAYOUTS, steps 1-3; every layout of RESHARDED, steps 1-3 (saving the adapters
    after step 2), then steps 3-4 resumed from them at another layout: all equal the straight one-rank
    run. Four launches: the two-rank layouts, the four-rank one, the two-rank resume, and one rank
    (the reference, then the one-rank resume)."""
    two = {name: [*LORA, *overrides] for name, (nproc, overrides) in sorted(LAYOUTS.items()) if nproc == 2}
    two.update({name: [*LORA, *overrides, *SAVE_AT_2] for name, (_, overrides, _) in sorted(RESHARDED.items())})
    assert all(RESHARDED[name][0] == 2 for name in RESHARDED)
    runs = _train(source, 2, two)
    runs.update(_train(source, 4, {n: [*LORA, *ov] for n, (nproc, ov) in sorted(LAYOUTS.items()) if nproc == 4}))
    assert sorted(runs) == sorted([*LAYOUTS, *RESHARDED])
    resumes = {}  # layout → the run that resumed its step-2 adapters
    for resume_nproc in sorted({nproc for _, _, (nproc, _) in RESHARDED.values()}, reverse=True):
        group = {n: ([*LORA, *ov], STEPS + 1) for n, (_, _, (p, ov)) in sorted(RESHARDED.items()) if p == resume_nproc}
        if resume_nproc == 1:  # the one-rank reference runs first in the one-rank launch
            group = {"one_rank": (LORA, STEPS + 1), **group}
        resumes.update(_train(source, resume_nproc, group))
    one_rank = resumes.pop("one_rank")
    steps = one_rank["printed"]
    assert sorted(steps) == [1, 2, 3, 4]
    # the adapters move the loss: steps 2-4 compare the optimizer's updates, not only the base
    assert steps[1]["loss"] - steps[3]["loss"] > 0.1, steps
    for layout in sorted(LAYOUTS):
        run = runs[layout]
        assert sorted(run["printed"]) == list(range(1, STEPS + 1))
        print(layout, end=" ")
        _assert_same(one_rank, run, range(1, STEPS + 1))
        # the startup line counts the whole model at every layout (pipeline stages add up, replicas once)
        assert _coverage(run["log"]) == _coverage(one_rank["log"]) == COVERAGE, run["log"][-2000:]
    for layout in sorted(RESHARDED):
        _check_resharded(source, one_rank, layout, runs[layout], resumes[layout])


def _check_resharded(source, one_rank, layout, first, second):
    """Steps 1-3 at `layout` (saving the adapters after step 2), then steps 3-4 resumed from them at
    another layout: both equal the straight one-rank run."""
    assert sorted(first["printed"]) == list(range(1, STEPS + 1))
    print(layout, end=" ")
    _assert_same(one_rank, first, range(1, STEPS + 1))
    step_dir = source / layout / "checkpoints" / "step_0000002"
    if layout == "tp2_sp":  # adapters (+ their optimizer state) only, with global keys
        tensors = _checkpoint_tensors(step_dir)
        model = {k: n for k, n in tensors.items() if not k.startswith(("optimizer", "rng_state"))}
        assert model and all(".adapter." in k for k in model), sorted(model)[:10]
        assert all(any(f"decoder.layers.{i}." in k for k in model) for i in range(4)), sorted(model)[:10]
        base = sum(_checkpoint_tensors(source / "mcore").values())
        size, base_size = _dir_bytes(step_dir), _dir_bytes(source / "mcore")
        print(f"checkpoint {size} bytes, {sum(model.values())} adapter elements; base {base_size} bytes, {base}")
        assert sum(model.values()) < 0.15 * base
        # a full-parameter checkpoint is ~3x the base (weights + Adam's two moments)
        assert size < 0.25 * 3 * base_size
    assert sorted(second["printed"]) == [3, 4], second["printed"]
    print(f"{layout} -> resumed", end=" ")
    _assert_same(one_rank, second, [3, 4])


# name → (reference overrides (one rank), ranks, layout overrides)
VARIANTS = {
    "dora_tp2_sp": (DORA, 2, [TP2, SP]),
    "share_a_ep2": (SHARE_A, 2, [EP2]),
}


def test_peft_variants_match_one_rank(source):
    """Each variant at its layout against its own one-rank run (one launch of the one-rank runs, one
    of the variants' layouts)."""
    references = _train(source, 1, {f"{variant}_one_rank": VARIANTS[variant][0] for variant in sorted(VARIANTS)})
    assert {nproc for _, nproc, _ in VARIANTS.values()} == {2}
    runs = _train(
        source, 2, {variant: [*peft, *overrides] for variant, (peft, _, overrides) in sorted(VARIANTS.items())}
    )
    for variant in sorted(VARIANTS):
        reference, run = references[f"{variant}_one_rank"], runs[variant]
        assert sorted(run["printed"]) == sorted(reference["printed"]) == list(range(1, STEPS + 1))
        assert reference["printed"][1]["loss"] - reference["printed"][3]["loss"] > 0.1, reference["printed"]
        print(variant, end=" ")
        _assert_same(reference, run, range(1, STEPS + 1))


# The hybrid mixers: a tiny Qwen3.5 (three Gated DeltaNet layers, then a gated attention layer) with
# DoRA rank 4 on every mixer projection and the shared experts. in_proj holds transformers' four
# projections (one A each) and six parts (q, k, v, z, b, a: a B and magnitude each, split over TP
# part by part); out_proj's row norms sum over TP; linear_qkv holds each head's query and gate.
HYBRID_DORA = ["peft.method=dora", "peft.rank=4", "peft.target_modules=[attention,shared_experts]"]


@pytest.fixture(scope="module")
def hybrid_source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peft_layouts_hybrid")
    vocab = len(AutoTokenizer.from_pretrained(str(REPO / "recipes/demo/tokenizer")))
    family = registry.family_by_name("qwen3_5_moe")
    _hf_model(family, family.tiny_hf_config(vocab_size=vocab), tmp / "hf")
    convert(tmp / "hf", tmp / "mcore")
    return tmp


def test_hybrid_mixers_dora_at_tp2_sp_matches_one_rank_and_resumes_at_one_rank(hybrid_source):
    """Steps 1-3 at TP2+SP (saving the adapters after step 2), then steps 3-4 resumed on one rank
    (the per-part factors resharded from TP2): both equal the straight one-rank run."""
    # two launches: TP2+SP, then on one rank the reference and the resume (in that order)
    first = _train(hybrid_source, 2, {"tp2_sp": [*HYBRID_DORA, TP2, SP, *SAVE_AT_2]})["tp2_sp"]
    later = _train(hybrid_source, 1, {"one_rank": (HYBRID_DORA, STEPS + 1), "tp2_sp": (HYBRID_DORA, STEPS + 1)})
    reference, second = later["one_rank"], later["tp2_sp"]
    assert sorted(reference["printed"]) == [1, 2, 3, 4]
    assert reference["printed"][1]["loss"] - reference["printed"][3]["loss"] > 0.1, reference["printed"]
    assert "on 16 modules" in reference["log"], reference["log"][-2000:]  # 3 x 2 GDN, 2 attention, 4 x 2 shared
    assert sorted(first["printed"]) == list(range(1, STEPS + 1))
    print("hybrid tp2_sp", end=" ")
    _assert_same(reference, first, range(1, STEPS + 1))
    assert sorted(second["printed"]) == [3, 4], second["printed"]
    print("hybrid tp2_sp -> resumed on one rank", end=" ")
    _assert_same(reference, second, [3, 4])
