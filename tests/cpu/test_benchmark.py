"""benchmarks/benchmark.py on CPU with tiny shapes: the report is complete and self-consistent.

Runs in this process (`compare` runs arms in-process on CPU): the moe-sft arm (the production
Trainer with the synthetic workload) and the transformers arm at two token budgets, 2 timed steps
and 1 profiled step each, then the ceilings. Checks, per run: the tokens counted are the real
(non-padding) tokens of the workload's batches and the ones the arm was fed; the model FLOPs are
the formula's (moe_sft.trainer.flops) recomputed here; throughput, TFLOP/s and MFU follow from
them; the phases are known names, cover the expected parts and sum to no more than the profiled
step's wall time; both arms saw the same token ids. A DeepSeek-V3-style tiny model (MLA, shared
expert, dense first layer, MTP) runs through the moe-sft arm too.
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.phases import PHASES
from benchmarks.workload import Workload, hf_config, model_shape, real_tokens
from moe_sft.runtime import distributed
from moe_sft.trainer import flops

BUDGETS = (128, 256)
TOKENS_PER_STEP = 512
STEPS = 2
LORA = (4, 8.0)  # rank, alpha of the LoRA arms (one budget: 128)


def _benchmark():
    from tests.scripts import load_script

    return load_script("benchmarks/benchmark.py", "benchmark_tool")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    tool = _benchmark()
    common = [
        "--budgets",
        ",".join(map(str, BUDGETS)),
        "--tokens-per-step",
        str(TOKENS_PER_STEP),
        "--warmup",
        "0",
        "--steps",
        str(STEPS),
        "--profile-steps",
        "1",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    try:
        assert tool.main(["compare", "--model", "tiny", *common]) == 0
        lora = [
            "--arms",
            "moe-sft-lora,moe-sft-lora-fp8,transformers-peft",
            "--lora-rank",
            str(LORA[0]),
            "--lora-alpha",
            str(LORA[1]),
        ]
        assert tool.main(["compare", "--model", "tiny", *lora, *common[:1], "128", *common[2:]]) == 0
        assert tool.main(["train", "--arm", "moe-sft", "--model", "tiny_dsv3", *common[:1], "128", *common[2:]]) == 0
        assert (
            tool.main(
                [
                    "ceilings",
                    "--model",
                    "tiny",
                    "--budget",
                    "128",
                    "--warmup",
                    "0",
                    "--iters",
                    "1",
                    "--device",
                    "cpu",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        distributed.destroy()  # leave no process group behind for other test modules
    return json.loads((out / "benchmark.json").read_text()), (out / "benchmark.md").read_text()


def _runs(data, model):
    return [r for r in data["runs"] if r["model"] == model]


def test_every_run_is_complete(report):
    data, _ = report
    runs = _runs(data, "tiny")
    assert sorted((r["arm"], r["budget"]) for r in runs) == sorted(
        [(arm, b) for arm in ("moe-sft", "transformers") for b in BUDGETS]
        + [("moe-sft-lora", 128), ("moe-sft-lora-fp8", 128), ("transformers-peft", 128)]
    )
    keys = {
        "tokens_per_s_per_gpu",
        "tflops_per_gpu",
        "mfu_pct",
        "peak_allocated_gib",
        "peak_reserved_gib",
        "phases_ms",
        "profiled_step_seconds",
        "step_seconds",
        "model_flop",
        "real_tokens",
        "losses",
        "implementation",
        "host_syncs",
        "step_events",
        "step_real_tokens",
        "step_model_flop",
        "executed_flop",
        "hw_tflops_per_gpu",
    }
    for r in runs + _runs(data, "tiny_dsv3"):
        assert r["status"] == "ok", r
        assert keys <= set(r), keys - set(r)
        assert len(r["step_seconds"]) == len(r["losses"]) == STEPS
        assert r["host_syncs"] is None  # CPU: no device to wait for, the census step is not run
        assert all(0 < loss < 20 for loss in r["losses"])


def test_tokens_and_flops_follow_from_the_workload(report):
    data, _ = report
    for r in data["runs"]:
        family, cfg = hf_config(r["model"], r["layers"])
        workload = Workload(budget=r["budget"], micro_batches=r["micro_batches"], vocab=cfg.vocab_size)
        steps = range(r["warmup"], r["warmup"] + r["steps"])
        batches = [workload.global_batch(s) for s in steps]
        docs = [n for batch in batches for mb in batch for n in flops.document_lengths(mb)]
        assert r["real_tokens"] == r["fed_tokens"] == sum(docs) == sum(real_tokens(b) for b in batches)
        assert r["micro_batches"] == TOKENS_PER_STEP // r["budget"]
        assert r["real_tokens"] == r["steps"] * r["micro_batches"] * r["budget"]  # filled, no padding
        shape = model_shape(r["model"], r["layers"], run_mtp=r.get("mtp_trained", False))
        assert r["model_flop"] == sum(flops.train_step_flops(shape, b) for b in batches)
        # hardware FLOPs: our LM head runs over the loss rows only, transformers' over every token
        if "lora" in r["arm"] or r["arm"] == "transformers-peft":  # forward, input grads, adapter weight grads
            plan = _lora_plan(r["arm"])
            ours = r["arm"].startswith("moe-sft")  # our LM head runs over the loss rows only
            lora = sum(flops.lora_step_flops(shape, b, plan, heads_over_loss_rows=ours) for b in batches)
            assert r["executed_flop"] == lora < r["model_flop"]
        elif r["arm"].startswith("moe-sft"):
            assert r["executed_flop"] == sum(flops.executed_step_flops(shape, b) for b in batches) < r["model_flop"]
        else:
            assert r["executed_flop"] == r["model_flop"]
        seconds = sum(r["step_seconds"])
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["real_tokens"] / seconds)
        assert r["tflops_per_gpu"] == pytest.approx(r["model_flop"] / seconds / 1e12)
        assert r["hw_tflops_per_gpu"] == pytest.approx(r["executed_flop"] / seconds / 1e12)
        assert r["mfu_pct"] == pytest.approx(100 * r["tflops_per_gpu"] / 989.0)


def _lora_plan(arm: str):
    from benchmarks.hf import PEFT_PLAN_TARGETS
    from moe_sft.plan.peft_memory import PeftPlan

    targets = ("attention", "experts") if arm.startswith("moe-sft-lora") else PEFT_PLAN_TARGETS
    return PeftPlan(rank=LORA[0], target_modules=targets)


def test_the_lora_arms_train_the_same_adapters_and_label_their_flops(report):
    """moe-sft-lora and transformers-peft (peft's LoRA on q/k/v/o_proj and, through
    target_parameters, the fused experts) train as many parameters; the report gives tokens/s
    first, then what a LoRA step executes next to the model FLOPs of full SFT, each labelled."""
    data, md = report
    ours, peft = (
        next(r for r in _runs(data, "tiny") if r["arm"] == arm) for arm in ("moe-sft-lora", "transformers-peft")
    )
    assert ours["peft"] == peft["peft"] == "lora"
    assert ours["trained_params_rank0"] == peft["trained_params_rank0"] > 0
    assert "target_parameters" in peft["implementation"] and "r4 alpha 8" in peft["implementation"]
    assert ours["fed_digest"] == peft["fed_digest"]
    for r in (ours, peft):
        assert r["executed_flop_kind"] == "LoRA step: forward, input gradients, adapter weight gradients"
        line = next(x for x in md.splitlines() if x.startswith(f"- {r['arm']} tiny L2 budget 128: "))
        tokens = line.index(f"{r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU")
        assert tokens < line.index("a LoRA step executes") < line.index("the model FLOPs of full SFT"), line
    fp8 = next(r for r in _runs(data, "tiny") if r["arm"] == "moe-sft-lora-fp8")  # the base in FP8 (random values)
    assert fp8["fp8_base"] and not ours["fp8_base"] and fp8["trained_params_rank0"] == ours["trained_params_rank0"]
    assert fp8["losses"][0] == pytest.approx(ours["losses"][0], abs=0.05)  # B = 0: the base's loss, FP8-rounded
    assert "tiny L2 budget 128: moe-sft-lora / transformers-peft tokens/s =" in md
    assert "tiny L2 budget 128: moe-sft-lora-fp8 / moe-sft-lora tokens/s =" in md
    assert "moe-sft / transformers-peft" not in md  # full SFT is not compared with a LoRA arm


def test_mtp_is_counted_for_deepseek(report):
    data, _ = report
    (r,) = _runs(data, "tiny_dsv3")
    assert r["mtp_trained"] is True
    with_mtp, without = (
        sum(flops.forward_flops_per_token(model_shape("tiny_dsv3", r["layers"], run_mtp=m)).values())
        for m in (True, False)
    )
    assert with_mtp > without


def test_phases_are_known_and_sum_to_at_most_the_step(report):
    data, _ = report
    for r in data["runs"]:
        phases = r["phases_ms"]
        assert set(phases) <= set(PHASES) and all(v >= 0 for v in phases.values())
        step_ms = 1e3 * r["profiled_step_seconds"]
        assert sum(phases.values()) <= step_ms * 1.001 + 0.01, (sum(phases.values()), step_ms)
        assert sum(phases.values()) >= 0.5 * step_ms  # the attribution covers the step's work
        expected = {"attention", "attention_core", "norms", "router", "experts", "lm_head", "loss", "optimizer"}
        assert expected <= set(phases), expected - set(phases)
        if r["arm"] == "moe-sft":
            assert {"dispatch", "grads"} <= set(phases)
        if r["model"] == "tiny_dsv3":
            assert {"shared_experts", "dense_mlp"} <= set(phases)
        assert set(r["phase_tflops"]) == {"experts", "attention_core"}


def test_arms_saw_the_same_tokens(report):
    data, md = report
    for budget in BUDGETS:
        ours, hf = (
            next(r for r in _runs(data, "tiny") if r["arm"] == arm and r["budget"] == budget)
            for arm in ("moe-sft", "transformers")
        )
        assert ours["fed_digest"] == hf["fed_digest"] and ours["real_tokens"] == hf["real_tokens"]
        assert f"tiny L2 budget {budget}: moe-sft / transformers tokens/s =" in md
    assert "(same tokens)" in md and "DIFFERENT" not in md


def test_markdown_and_ceilings(report):
    data, md = report
    assert "CPU SMOKE RUN" in md
    kinds = {c["kind"] for c in data["ceilings"]}
    assert kinds == {
        "matmul",
        "grouped_mm fwd",
        "grouped_mm fwd+bwd",
        "varlen attention fwd",
        "varlen attention fwd+bwd",
    }
    assert all(c["tflops"] > 0 for c in data["ceilings"])
    assert "| moe-sft | tiny | 2 | 1 (1) | 128 |" in md and "Ceilings" in md


def _event(eid, name, start, end, parent=None, device=False, kernels=(), annotation=False, seq=-1):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(
        id=eid,
        name=name,
        time_range=span,
        cpu_parent=parent,
        thread=1,
        fwd_thread=1,
        sequence_nr=seq,
        is_user_annotation=annotation,
        self_cpu_time_total=end - start,
        device_type=DeviceType.CUDA if device else DeviceType.CPU,
        kernels=[SimpleNamespace(name=n, duration=d) for n, d in kernels],
    )


def test_gpu_copies_of_cpu_ranges_are_not_counted_as_kernels():
    """torch.optim's record_function range shows up on the GPU timeline spanning its kernels (with
    or without the user-annotation flag) and may be attached to the CPU op like a kernel: the
    first H200 run then reported an optimizer phase of 15.8 s in a 1.2 s step."""
    from benchmarks.phases import SCOPE, attribute_events

    scope = _event(1, SCOPE + "optimizer", 0, 100)
    step = _event(
        2,
        "Optimizer.step#AdamW.step",
        1,
        99,
        parent=scope,
        kernels=[
            ("Optimizer.step#AdamW.step", 5000.0),
            ("fused_adamw_kernel", 40.0),
            ("Buffer Flush", 40.0),
            ("Activity Buffer Request", 40.0),
        ],
    )  # the profiler's own
    # ... and its host-side record of a full launch queue, with "kernels" of seconds attached
    queue_full = _event(
        7,
        "Command Buffer Full",
        3,
        4,
        parent=scope,
        kernels=[("Command Buffer Full", 7e6), ("fused_adamw_kernel", 7e6)],
    )
    events = [
        scope,
        step,
        queue_full,
        _event(3, "Optimizer.step#AdamW.step", 2, 5002, device=True),  # the GPU-side copy
        _event(4, "Optimizer.step#AdamW.step", 2, 5002, device=True, annotation=True),
        _event(5, "fused_adamw_kernel", 10, 50, device=True),
        _event(6, "stray_kernel", 60, 70, device=True),
    ]  # tied to no op
    ops = {}
    totals = attribute_events(events, device=True, ops=ops)
    assert totals == {"optimizer": 40.0, "other": 10.0}
    assert ops == {("optimizer", "Optimizer.step#AdamW.step"): 40.0}  # where the phase's time went


def test_the_adam_kernel_tied_to_no_op_counts_in_the_optimizer():
    """The clip + Adam Triton kernel is launched outside any torch op: the profiler ties it to none
    (the first profiles with it put its ~37 ms in "other"). Named, it is the optimizer's;
    where a profiler does tie it to an op, it is not counted twice."""
    from benchmarks.phases import SCOPE, attribute_events

    scope = _event(1, SCOPE + "optimizer", 0, 100)
    norm = _event(2, "aten::_foreach_norm", 1, 9, parent=scope, kernels=[("multi_tensor_apply_kernel", 5.0)])
    events = [
        scope,
        norm,
        _event(3, "multi_tensor_apply_kernel", 10, 15, device=True),
        _event(4, "_adam_kernel", 20, 50, device=True),
        _event(5, "_adam_kernel", 50, 70, device=True),
        _event(6, "stray_kernel", 80, 90, device=True),
    ]
    ops = {}
    assert attribute_events(events, device=True, ops=ops) == {"optimizer": 55.0, "other": 10.0}
    assert ops[("optimizer", "_adam_kernel")] == 50.0
    tied = _event(7, "Adam", 20, 70, parent=scope, kernels=[("_adam_kernel", 30.0), ("_adam_kernel", 20.0)])
    assert attribute_events([scope, norm, tied] + events[2:], device=True) == {"optimizer": 55.0, "other": 10.0}


def test_idle_gaps_sum_the_gpu_waits_by_the_kernel_that_ended_them():
    from benchmarks.phases import idle_gaps

    events = [
        _event(1, "aten::mm", 0, 5),  # a CPU op: not on the GPU timeline
        _event(2, "gemm", 0, 100, device=True),
        _event(3, "side_stream_kernel", 50, 150, device=True),  # overlaps: no gap before it
        _event(4, "topk", 410, 420, device=True),  # waited 260 us
        _event(5, "aten::mm", 500, 9000, device=True, annotation=True),
        _event(6, "topk", 425, 430, device=True),  # 5 us: below the threshold
        _event(7, "sum", 1430, 1440, device=True),  # waited 1000 us
        _event(8, "Buffer Flush", 1500, 3000, device=True),
        _event(9, "topk", 2440, 2450, device=True),
    ]  # waited 1000 us
    gaps = idle_gaps(events, per=2)  # two profiled steps
    assert gaps == {"total_ms": 1.13, "by_next_kernel": [["topk", 0.63], ["sum", 0.5]]}


def test_top_ops_keeps_each_phases_costliest_ops_in_ms_per_step():
    from benchmarks.phases import top_ops

    ops = {
        ("norms", "aten::mul"): 3000.0,
        ("norms", "aten::_fused_rms_norm"): 5000.0,
        ("loss", "ce"): 800.0,
        ("norms", "aten::sum"): 1000.0,
    }
    assert top_ops(ops, per=2, top=2) == {
        "norms": [["aten::_fused_rms_norm", 2.5], ["aten::mul", 1.5]],
        "loss": [["ce", 0.4]],
    }


def test_compiled_kernels_count_in_the_phase_that_launched_them():
    """inductor wraps each Triton launch in a CPU range named like the kernel: that is not a GPU
    copy of a CPU range, and its kernel belongs to the enclosing phase (first seen on an H200: the
    compiled cross entropy's kernels were dropped and "loss" read 0.2 ms)."""
    from benchmarks.phases import SCOPE, attribute_events

    scope = _event(1, SCOPE + "loss", 0, 100)
    launch = _event(2, "triton_red_fused_amax_0", 1, 9, parent=scope, kernels=[("triton_red_fused_amax_0", 700.0)])
    events = [scope, launch, _event(3, "triton_red_fused_amax_0", 10, 710, device=True)]
    assert attribute_events(events, device=True) == {"loss": 700.0}


def test_host_sync_lines_name_the_busiest_lines_per_arm():
    from benchmarks.results import host_sync_lines

    group = [
        dict(arm="moe-sft", host_syncs={"trainer/step.py:50": 8, "a.py:1": 2, "b.py:2": 1}),
        dict(arm="transformers", host_syncs={}),
        dict(arm="cpu-run"),
    ]
    lines = host_sync_lines(group, top=2)
    assert lines == [
        "",
        "- moe-sft: 11 host syncs in one step: trainer/step.py:50 x8, a.py:1 x2, 1 more lines",
        "- transformers: 0 host syncs in one step",
    ]


def test_one_time_work_is_named_with_the_step_it_slowed():
    from benchmarks.measure import _one_time_events
    from benchmarks.results import one_time_event_lines
    from moe_sft.kernels import triton_launch

    before = _one_time_events("cpu")

    def _rope_kernel():
        pass

    key = (_rope_kernel, 0, (("BLOCK", 64),), (torch.bfloat16, True))  # triton_launch's key: kernel first
    triton_launch._cache[key] = None
    try:
        assert dict(_one_time_events("cpu") - before) == {"triton _rope_kernel": 1}
    finally:
        del triton_launch._cache[key]
    # as read back from benchmark.json: the step index is a string
    group = [
        dict(
            arm="moe-sft",
            gpus=1,
            step_seconds=[0.5, 1.2, 0.3],
            step_events={"1": {"triton _rope_kernel": 2}},
            step_real_tokens=[30000, 31000, 18000],
            step_model_flop=[1.6e14, 1.7e14, 0.8e14],
        ),
        dict(arm="transformers", step_seconds=[1.1], step_events={}),
        dict(arm="old-run"),
    ]
    assert one_time_event_lines(group) == [
        "",
        "- moe-sft: one-time work in timed steps: step 2 (1.200 s): "
        "triton _rope_kernel 2. The other 2 steps: 60,000 tokens/s/GPU, "
        "300.0 TFLOP/s/GPU",
    ]


def test_phase_detail_lines_name_costly_ops_host_time_and_idle_gaps():
    from benchmarks.results import phase_detail_lines

    run = dict(
        arm="moe-sft",
        phase_ops={"router": [["aten::topk", 4.4], ["aten::sum", 3.2]]},
        gpu_idle={"total_ms": 12.5, "by_next_kernel": [["_rope_kernel", 6.0]], "host_ms_by_phase": {"router": 20.0}},
    )
    assert phase_detail_lines([run]) == [
        "",
        "- moe-sft router: aten::topk 4.4, aten::sum 3.2; host 20.0 ms",
        "- moe-sft: GPU idle 12.5 ms in the profiled step, before: _rope_kernel 6.0",
    ]


def test_the_lora_arms_take_the_whole_qwen3_30b_on_one_h200():
    """`--layers 48` with the LoRA arms: the preset at 48 layers is the recipe's model, and the
    planner puts the arm's run (rank 16 on attention + experts, no recompute, 8192 tokens) on one
    H200 with the bf16 base, on one H100 with the FP8 base only (the recipes of issue 46)."""
    from moe_sft.plan import hardware, memory
    from moe_sft.plan.layout import Layout
    from moe_sft.plan.peft_memory import PeftPlan
    from moe_sft.plan.shapes import load_shape

    shape = model_shape("qwen3_30b", 48, run_mtp=False)
    recipe_shape, _ = load_shape("qwen3_30b_a3b")
    assert (
        (shape.num_layers, shape.num_experts, shape.hidden) == (recipe_shape.num_layers, 128, 2048) == (48, 128, 2048)
    )
    lay = Layout(world=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1)

    def gib(fp8: bool, recompute=None) -> float:
        train = memory.Training(tokens=8192, micro_batches=4, recompute=recompute, peft=PeftPlan(rank=16, fp8_base=fp8))
        return memory.stage_memory(shape, lay, 0, train).total / memory.GIB

    h200, h100 = hardware.GPUS["h200_141gb"].memory_gib, hardware.GPUS["h100_80gb"].memory_gib
    assert gib(False) < h200 < gib(False) + 10  # measured: 117.1 GiB allocated (issue 46)
    assert gib(False, "full") > h100 > gib(True, "full")


def test_every_preset_reads_its_config_with_its_layers():
    """Each preset's config (a vision-language release's: its language model) passes its family's
    checks at the preset's layer count, the layer types cut to match, and gives a model shape."""
    from benchmarks.workload import PRESETS

    for name, preset in PRESETS.items():
        family, cfg = hf_config(name)
        assert family.name == preset.family and cfg.num_hidden_layers == preset.layers, name
        if getattr(cfg, "layer_types", None):
            assert len(cfg.layer_types) == preset.layers, name
        assert model_shape(name).num_layers == preset.layers, name
