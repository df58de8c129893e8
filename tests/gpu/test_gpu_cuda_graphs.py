"""trainer.cuda_graphs on one GPU: the graphed MoE halves train as the eager layers do.

Two quickstart runs from the same converted model, both with the graphs captured (so both pad to
data.pack_length and keep the expert wgrad on the compute stream): one replays them, the other
(MOE_SFT_CUDA_GRAPHS_REPLAY=0) runs the same layers eagerly. The first step's loss is a forward of
the same weights; its grad norm covers every gradient, so a placeholder added twice, a gradient the
graph dropped or a stale aux-loss scale shows there. Later steps compound bf16 differences, so they
get a looser bound. The eval at step 10 runs without gradients, through the eager path.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.gpu
STEPS = 20


def _run(tmp_path, name: str, replay: bool):
    from tests.dist.launch import torchrun
    from tools.plot_metrics import read_scalars

    proc = torchrun(1, [f"trainer.max_steps={STEPS}", "trainer.log_interval=1", "trainer.export_hf_at_end=false",
                        "trainer.eval_interval=10", "trainer.cuda_graphs=true", "checkpoint.save_interval=0",
                        f"trainer.output_dir={tmp_path / name}", f"model.hf_path={tmp_path / 'hf'}",
                        f"model.mcore_path={tmp_path / 'mcore'}"],
                    env={"MOE_SFT_CUDA_GRAPHS_REPLAY": "1" if replay else "0"})
    counts = re.search(r"CUDA graphs: (\d+) MoE-half replays, (\d+) eager training forwards", proc.stdout)
    assert counts, proc.stdout[-3000:]
    scalars = read_scalars(tmp_path / name)  # TensorBoard's float32 values, not the console's 4 digits
    metrics = {k: dict(scalars[f"train/{k}"]) for k in ("loss", "grad_norm")}
    return metrics, int(counts.group(1)), int(counts.group(2)), proc.stdout


def test_graphed_moe_trains_as_eager(tmp_path):
    graphed, replays, eager_calls, out = _run(tmp_path, "graphed", replay=True)
    eager, replays_off, eager_off, _ = _run(tmp_path, "eager", replay=False)
    layers = int(re.search(r"the MoE half of (\d+) layers captured", out).group(1))
    micro_batches = 2  # the quickstart's global_batch_size on one GPU
    assert layers > 0
    assert (replays, eager_calls) == (STEPS * micro_batches * layers, 0)
    assert (replays_off, eager_off) == (0, STEPS * micro_batches * layers)

    first = {k: (graphed[k][1], eager[k][1]) for k in ("loss", "grad_norm")}
    print("step 1 graphed vs eager:", first)
    assert abs(first["loss"][0] - first["loss"][1]) <= 1e-6 * abs(first["loss"][1])
    assert abs(first["grad_norm"][0] - first["grad_norm"][1]) <= 1e-4 * abs(first["grad_norm"][1])
    loss_g, loss_e = graphed["loss"], eager["loss"]
    worst = max(abs(loss_g[s] - loss_e[s]) / abs(loss_e[s]) for s in range(1, STEPS + 1))
    print(f"worst relative loss difference over {STEPS} steps: {worst:.2e}; last losses "
          f"{loss_g[STEPS]:.4f} vs {loss_e[STEPS]:.4f}")
    assert worst <= 2e-2
    assert loss_g[STEPS] < loss_g[1]  # it learns
