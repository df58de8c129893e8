"""Telemetry through torchrun (CPU, gloo): the quickstart for 2 steps on one rank, on EP=2 x DP=2
and on PP=2, with the same data.

Per MoE layer, the expert loads that rank 0 writes to TensorBoard (one histogram bucket per
expert, exact counts) sum to top-k x the real (non-padding) tokens of the global batch (from the
micro-batches' document lengths; on one rank, which pads nothing, also tokens/s x step time),
and equal the one-rank run's loads expert by expert: the EP run sums them over two
data-parallel ranks, the PP run gathers layer 1 from the second stage, and both pad
micro-batches to pack_length (padding must not be counted). The console line carries the
summary keys and rank 0 prints the progress line with an ETA.
"""

from __future__ import annotations

import re

import pytest

from tests.dist.launch import step_metrics, torchrun_cases

TOP_K, LAYERS, STEPS = 2, 2, 2
LAYOUTS = {
    "one": (1, []),
    "ep2": (2, ["parallel.expert_model_parallel_size=2"]),
    "pp2": (2, ["parallel.pipeline_model_parallel_size=2"]),
}
PROGRESS = re.compile(
    r"^\[moe-sft\] step (\d+)/(\d+) \((\d+\.\d)%\) elapsed \d\d:\d\d:\d\d "
    r"ETA (\d\d:\d\d:\d\d|--:--:-- \(after the warm-up step\))( at [\d.e+-]+ s/step)?$"
)


def _tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    loads = {
        (e.step, layer): [int(c) for c in e.histogram_value.bucket]
        for layer in range(LAYERS)
        for e in events.Histograms(f"moe/layer_{layer}/expert_load")
    }
    tflop = {e.step: e.value for e in events.Scalars("perf/detail/model_tflop_per_step")}
    real = {e.step: e.value for e in events.Scalars("perf/detail/real_tokens")}
    seconds = {e.step: e.value for e in events.Scalars("train/step_seconds")}
    all_tokens = {e.step: round(e.value * seconds[e.step]) for e in events.Scalars("train/tokens_per_s")}
    return loads, tflop, real, all_tokens


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("telemetry")
    out = {}
    for nproc in sorted({nproc for nproc, _ in LAYOUTS.values()}):  # one launch per world size
        names = [name for name, (n, _) in LAYOUTS.items() if n == nproc]
        logs = torchrun_cases(
            nproc,
            [
                [
                    f"trainer.max_steps={STEPS}",
                    "trainer.log_interval=1",
                    "trainer.export_hf_at_end=false",
                    f"trainer.output_dir={tmp / name}",
                    f"model.hf_path={tmp / 'hf'}",
                    f"model.mcore_path={tmp / 'mcore'}",
                    *LAYOUTS[name][1],
                ]
                for name in names
            ],
        )
        out.update({name: (log, *_tensorboard(tmp / name)) for name, log in zip(names, logs)})
    assert sorted(out) == sorted(LAYOUTS)
    return out


def test_expert_loads_sum_to_topk_tokens_and_match_one_rank(runs):
    one_loads, one_tflop, one_real, one_all = runs["one"][1:]
    assert sorted(one_loads) == [(s, layer) for s in range(1, STEPS + 1) for layer in range(LAYERS)]
    assert one_real == one_all and all(one_real.values()), (one_real, one_all)  # one rank: no padding
    for name in ("one", "ep2", "pp2"):
        _, loads, tflop, real, _ = runs[name]
        assert real == one_real, (name, real, one_real)  # padded to 1024 there: not counted
        for step in range(1, STEPS + 1):
            for layer in range(LAYERS):
                counts = loads[(step, layer)]
                assert len(counts) == 8 and sum(counts) == TOP_K * real[step], (name, step, layer, counts)
                assert counts == one_loads[(step, layer)], (name, step, layer, counts, one_loads)
        # same documents: same model FLOPs, counted once per data-parallel replica
        assert tflop == pytest.approx(one_tflop, rel=1e-12), (name, tflop, one_tflop)


def test_console_has_summary_keys_and_progress_with_eta(runs):
    for name, (stdout, *_rest) in runs.items():
        metrics = step_metrics(stdout)
        assert sorted(metrics) == [1, 2], name
        for key in ("max_load_ratio", "dead_experts", "router_entropy", "tflops_per_gpu", "loss"):
            assert key in metrics[2], (name, key, metrics[2])
        assert 1.0 <= metrics[2]["max_load_ratio"] <= 8 / TOP_K  # max/mean load of top-2 of 8
        assert 0.0 < metrics[2]["router_entropy"] <= 1.0 and metrics[2]["tflops_per_gpu"] > 0
        assert not any("layer_" in key for key in metrics[2])  # per-layer values: TensorBoard only
        progress = [m for line in stdout.splitlines() if (m := PROGRESS.match(line))]
        assert [m.group(1, 2, 3) for m in progress] == [("1", "2", "50.0"), ("2", "2", "100.0")], stdout[-2000:]
        assert progress[0].group(4).startswith("--") and progress[1].group(4) == "00:00:00"
        assert progress[1].group(5)  # "at X s/step" from the second step on
