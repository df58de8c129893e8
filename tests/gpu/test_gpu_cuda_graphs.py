"""trainer.cuda_graphs on one GPU: the graphed MoE halves train as the eager layers do.

Per family, the quickstart recipe from the same converted model, three runs:
- graphs: trainer.cuda_graphs=true;
- eager: the same, but trainer.cuda_graphs_replay=false runs the captured layers eagerly (the same
  padding to data.pack_length, the same stream use): the first step's loss is a forward of the same
  weights and its grad norm covers every gradient, so a placeholder added twice, a gradient the
  graph dropped or a stale aux-loss scale shows there, bit for bit;
- off (Qwen3 only): trainer.cuda_graphs=false, micro-batches not padded, nothing captured: what the
  warm-up iterations accumulated (main grads, aux-loss logs, expert-bias counts) must be gone.
Later steps compound bf16 differences and get a looser bound. The eval at step 10 runs without
gradients, through the eager path. DeepSeek-V3 brings MLA, the shared expert, sigmoid routing
with the expert bias, a dense first layer and an MTP layer (eager, beside the graphs).
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.gpu
STEPS = 12
MICRO_BATCHES = 2  # the quickstart's global_batch_size on one GPU


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "mixtral"])
def model_dir(request, tmp_path_factory):
    from transformers import AutoTokenizer

    from moe_sft.conversion.convert import convert
    from moe_sft.models import registry
    from tests.deepseek_mtp import write_tiny_deepseek_with_mtp
    from tests.dist.launch import REPO, make_tiny_model

    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_moe":
        return request.param, make_tiny_model(tmp)
    vocab = len(AutoTokenizer.from_pretrained(str(REPO / "recipes/demo/tokenizer")))
    if request.param == "deepseek_v3":
        write_tiny_deepseek_with_mtp(tmp / "hf", vocab)
    else:
        family = registry.family_by_name(request.param)
        family.hf_model_class(family.tiny_hf_config(vocab_size=vocab)).save_pretrained(tmp / "hf")
    convert(tmp / "hf", tmp / "mcore")
    return request.param, tmp


def _run(tmp, name: str, graphs: bool, replay: bool = True, gpus: int = 1, extra: tuple = ()):
    from tests.dist.launch import torchrun
    from tools.plot_metrics import read_scalars

    proc = torchrun(
        gpus,
        [
            *extra,
            f"trainer.max_steps={STEPS}",
            "trainer.log_interval=1",
            "trainer.export_hf_at_end=false",
            "trainer.eval_interval=10",
            f"trainer.cuda_graphs={str(graphs).lower()}",
            "checkpoint.save_at_end=false",
            "model.create_tiny_if_missing=false",
            f"trainer.output_dir={tmp / name}",
            f"model.hf_path={tmp / 'hf'}",
            f"model.mcore_path={tmp / 'mcore'}",
            f"trainer.cuda_graphs_replay={str(replay).lower()}",
        ],
    )
    scalars = read_scalars(tmp / name)  # TensorBoard's float32 values, not the console's 4 digits
    metrics = {k: dict(scalars[f"train/{k}"]) for k in ("loss", "grad_norm")}
    counts = re.search(r"CUDA graphs: (\d+) MoE-half replays, (\d+) eager training forwards", proc.stdout)
    layers = re.search(r"the MoE half of (\d+) layers captured", proc.stdout)
    assert bool(counts) == bool(layers) == graphs, proc.stdout[-3000:]
    counted = (int(counts.group(1)), int(counts.group(2)), int(layers.group(1))) if graphs else None
    return metrics, counted, proc.stdout


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_graphed_moe_trains_as_eager(model_dir):
    family, tmp = model_dir
    graphed, (replays, eager_calls, layers), _ = _run(tmp, "graphed", graphs=True)
    eager, (replays_off, eager_off, _), _ = _run(tmp, "eager", graphs=True, replay=False)
    assert layers > 0
    assert (replays, eager_calls) == (STEPS * MICRO_BATCHES * layers, 0)
    assert (replays_off, eager_off) == (0, STEPS * MICRO_BATCHES * layers)

    first = {k: (graphed[k][1], eager[k][1]) for k in ("loss", "grad_norm")}
    worst = max(_rel(graphed["loss"][s], eager["loss"][s]) for s in range(1, STEPS + 1))
    print(
        f"{family}: step 1 graphed vs eager {first}; worst relative loss difference over {STEPS} steps "
        f"{worst:.2e}; last losses {graphed['loss'][STEPS]:.4f} vs {eager['loss'][STEPS]:.4f}"
    )
    assert first["loss"][0] == first["loss"][1]
    assert _rel(*first["grad_norm"]) <= 1e-5
    assert worst <= 2e-2
    assert graphed["loss"][STEPS] < graphed["loss"][1]  # it learns
    if family == "qwen3_moe":
        off, _, _ = _run(tmp, "off", graphs=False)
        print(
            f"{family}: step 1 graphed vs no graphs (unpadded) loss {graphed['loss'][1]} vs {off['loss'][1]}, "
            f"grad norm {graphed['grad_norm'][1]} vs {off['grad_norm'][1]}"
        )
        assert _rel(graphed["loss"][1], off["loss"][1]) <= 1e-3
        assert _rel(graphed["grad_norm"][1], off["grad_norm"][1]) <= 1e-2
        assert max(_rel(graphed["loss"][s], off["loss"][s]) for s in range(1, STEPS + 1)) <= 2e-2


@pytest.mark.parametrize("fp8_base", [False, True], ids=["bf16-base", "fp8-base"])
@pytest.mark.parametrize("model_dir", ["qwen3_moe"], indirect=True)
def test_graphed_moe_with_adapters_trains_as_eager(model_dir, fp8_base):
    """LoRA on every linear, the routed experts and the shared expert's linears, frozen base (in bf16
    or FP8): the adapters' grouped GEMMs and their gradients are captured with the MoE half; replayed,
    the first step equals the eager layers' bit for bit, and the adapters learn."""
    family, tmp = model_dir
    lora = ("peft.method=lora", "peft.rank=8", "peft.target_modules=[all_linear,experts]")
    lora += ("peft.fp8_base=true",) if fp8_base else ()
    name = "lora_fp8" if fp8_base else "lora"
    graphed, (replays, eager_calls, layers), out = _run(tmp, f"{name}_graphed", graphs=True, extra=lora)
    eager, (replays_off, eager_off, _), _ = _run(tmp, f"{name}_eager", graphs=True, replay=False, extra=lora)
    assert "LoRA r8 on" in out, out[-3000:]
    assert layers > 0 and (replays, eager_calls) == (STEPS * MICRO_BATCHES * layers, 0)
    assert (replays_off, eager_off) == (0, STEPS * MICRO_BATCHES * layers)
    first = {k: (graphed[k][1], eager[k][1]) for k in ("loss", "grad_norm")}
    worst = max(_rel(graphed["loss"][s], eager["loss"][s]) for s in range(1, STEPS + 1))
    print(f"{family} {name}: step 1 graphed vs eager {first}; worst relative loss difference {worst:.2e}")
    assert first["loss"][0] == first["loss"][1]
    assert _rel(*first["grad_norm"]) <= 1e-5
    assert worst <= 2e-2
    assert graphed["loss"][STEPS] < graphed["loss"][1]


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("model_dir", ["qwen3_moe", "deepseek_v3"], indirect=True)
def test_graphed_moe_at_ep_trains_as_eager(model_dir, ep):
    """EP 2 and 4 on as many GPUs: the graphs hold the allgather dispatcher's NCCL collectives and its
    static-row permutation (kernels/permute.py; at EP4 capped at 2x the expected rows); replayed,
    they give the eager layers' first step bit for bit."""
    import torch

    if torch.cuda.device_count() < ep:
        pytest.skip(f"needs {ep} GPUs")
    family, tmp = model_dir
    layout = (
        f"parallel.expert_model_parallel_size={ep}",
        "model.moe_token_dispatcher_type=allgather",  # auto: alltoall past top-k (2) ranks
        f"trainer.global_batch_size={ep}",  # one micro-batch per rank (data parallel EP for the dense part)
    )
    graphed, (replays, eager_calls, layers), out = _run(tmp, f"graphed_ep{ep}", True, gpus=ep, extra=layout)
    eager, (replays_off, eager_off, _), out_off = _run(tmp, f"eager_ep{ep}", True, replay=False, gpus=ep, extra=layout)
    assert re.search(r"\d+ MoE layers permute a static row count per rank", out), out[-3000:]
    # a step whose routing exceeded the rows' capacity ran again eagerly (rare at 2x; trainer/row_capacity.py)
    reruns, reruns_off = (len(re.findall("runs again with exact row counts", o)) for o in (out, out_off))
    assert layers > 0 and (replays, eager_calls) == (STEPS * layers, reruns * layers)
    assert (replays_off, eager_off) == (0, (STEPS + reruns_off) * layers)
    first = {k: (graphed[k][1], eager[k][1]) for k in ("loss", "grad_norm")}
    worst = max(_rel(graphed["loss"][s], eager["loss"][s]) for s in range(1, STEPS + 1))
    print(f"{family} EP{ep}: step 1 graphed vs eager {first}; worst relative loss difference {worst:.2e}")
    assert first["loss"][0] == first["loss"][1]
    assert _rel(*first["grad_norm"]) <= 1e-5
    assert worst <= 2e-2
    assert graphed["loss"][STEPS] < graphed["loss"][1]


def test_graphed_steps_above_the_row_capacity_run_again_eagerly(tmp_path):
    """EP4 with the static rows' capacity cut to 1x: in nearly every step some rank's routing exceeds
    it inside the graph; the trainer sees the recorded excess, puts the step's state back and runs it
    again eagerly with exact rows (trainer/row_capacity.py). The run trains as one without graphs."""
    import torch

    from tests.dist.launch import make_tiny_model

    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    tmp = make_tiny_model(tmp_path)
    layout = (
        "parallel.expert_model_parallel_size=4",
        "model.moe_token_dispatcher_type=allgather",
        "trainer.global_batch_size=4",
    )
    capped = (*layout, "model.moe_static_rows_capacity=1")
    graphed, (replays, eager_calls, layers), out = _run(tmp, "capped", True, gpus=4, extra=capped)
    plain, _, _ = _run(tmp, "plain", False, gpus=4, extra=layout)
    reruns = len(re.findall("runs again with exact row counts", out))
    print(f"EP4 capacity 1x: {reruns} of {STEPS} steps ran again; losses {graphed['loss']} vs {plain['loss']}")
    assert reruns >= STEPS // 2 and eager_calls == reruns * layers  # one micro-batch per rank
    assert replays == STEPS * layers
    assert _rel(graphed["loss"][1], plain["loss"][1]) <= 1e-3
    assert max(_rel(graphed["loss"][s], plain["loss"][s]) for s in range(1, STEPS + 1)) <= 2e-2


def _ep4_top8_of_16(tmp_path):
    """The tiny Qwen3-MoE with top-8 of 16 experts (a token's rows on up to all 4 ranks) and the
    EP4 allgather layout, one micro-batch per rank; skips without 4 GPUs."""
    import torch

    from tests.dist.launch import make_tiny_model

    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    layout = (
        "parallel.expert_model_parallel_size=4",
        "model.moe_token_dispatcher_type=allgather",
        "trainer.global_batch_size=4",
    )
    return make_tiny_model(tmp_path, num_experts=16, num_experts_per_tok=8), layout


def test_bf16_combine_at_ep4_trains_as_the_fp32_one(tmp_path):
    """EP4 with graphs, the allgather combine's reduce-scatter in bf16 (`model.moe_combine_dtype`, the
    default: two more roundings of a token's partial sums at EP4, as a TP layer's reduce-scatter) against
    megatron's fp32 one: the same losses and grad norms to bf16 precision over 12 steps. Top-8 of
    16 experts, so a token's rows lie on up to all 4 ranks (with the quickstart's top-2 at most two
    partial sums are nonzero, one addition either way, and the two runs are bit-equal)."""
    tmp, layout = _ep4_top8_of_16(tmp_path)
    bf16, _, out = _run(tmp, "bf16", True, gpus=4, extra=(*layout, "model.moe_combine_dtype=bf16"))
    fp32, _, _ = _run(tmp, "fp32", True, gpus=4, extra=(*layout, "model.moe_combine_dtype=fp32"))
    assert "the allgather's combine reduce-scatters in bf16" in out
    worst = {k: max(_rel(bf16[k][s], fp32[k][s]) for s in range(1, STEPS + 1)) for k in ("loss", "grad_norm")}
    print(f"EP4 bf16 vs fp32 combine: step 1 loss {bf16['loss'][1]} vs {fp32['loss'][1]}; worst relative {worst}")
    assert _rel(bf16["loss"][1], fp32["loss"][1]) <= 1e-3
    assert worst["loss"] <= 2e-2 and worst["grad_norm"] <= 5e-2
    assert bf16["loss"][STEPS] < bf16["loss"][1]


def test_dispatch_in_chunks_at_ep4_trains_as_one_dispatch(tmp_path):
    """EP4, each MoE layer's dispatch in 2 token chunks whose collectives are launched and waited
    across autograd nodes (`model.moe_dispatch_chunks`, moe_sft/layers/split_dispatch.py): captured
    in the graphs, replayed, it gives the eager layers' first step bit for bit (every NCCL launch is
    joined inside its capture), and it trains as the layers with one dispatch do. Top-8 of 16 experts."""
    tmp, layout = _ep4_top8_of_16(tmp_path)
    split = (*layout, "model.moe_dispatch_chunks=2")
    graphed, (replays, _, layers), out = _run(tmp, "split", True, gpus=4, extra=split)
    eager, _, _ = _run(tmp, "split_eager", True, replay=False, gpus=4, extra=split)
    whole, _, _ = _run(tmp, "whole", True, gpus=4, extra=layout)
    assert f"{layers} MoE layers dispatch in 2 token chunks" in out and replays >= STEPS * layers
    worst = {k: max(_rel(graphed[k][s], whole[k][s]) for s in range(1, STEPS + 1)) for k in ("loss", "grad_norm")}
    print(
        f"EP4 in 2 chunks: step 1 graphed {graphed['loss'][1]} eager {eager['loss'][1]} one dispatch "
        f"{whole['loss'][1]}; grad norm {graphed['grad_norm'][1]} / {eager['grad_norm'][1]} / "
        f"{whole['grad_norm'][1]}; worst relative against one dispatch {worst}"
    )
    assert graphed["loss"][1] == eager["loss"][1]
    assert _rel(graphed["grad_norm"][1], eager["grad_norm"][1]) <= 1e-5
    assert _rel(graphed["loss"][1], whole["loss"][1]) <= 1e-3
    assert worst["loss"] <= 2e-2 and worst["grad_norm"] <= 5e-2
