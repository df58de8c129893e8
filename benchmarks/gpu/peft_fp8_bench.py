"""LoRA on an FP8 base vs the same LoRA on a bf16 base, on one GPU, at the per-GPU shard shape of
recipes/deepseek_v3_lora_h200.yaml (671B on 8 x H200, EP8): a reduced DeepSeek-V3 stack with the
full widths (hidden 7168, MLA q_lora 1536 / kv_lora 512 / 128 heads, moe_ffn 2048, one shared expert,
vocab 129280) and the experts one GPU holds per layer at EP8 (256 / 8 = 32, top-8: the tokens one
EP rank's experts process per token of its own), fewer layers.

    python -m benchmarks.gpu.peft_fp8_bench                 # GPU: both arms, one JSON line
    python -m benchmarks.gpu.peft_fp8_bench --tiny          # CPU smoke run of the script (not a timing)

Each arm runs in its own process (clean allocator and parallel state): the model built as the
trainer builds it (the FP8 arm under fp8_base.placeholder_base, its base filled one layer at a
time through fp8_base.load_quantised with random values, never whole in bf16), adapters rank 16
on attention + experts, megatron's DDP (fp32 main grads) and distributed Adam, full recompute as
the recipe; then `--steps` timed steps of `--micro-batches` x `--tokens` tokens. Reported per arm:
peak torch.cuda.max_memory_allocated over the steps vs the planner's `allocated` for the same
reduced stack (moe_sft.plan.memory.stage_memory with the recipe's peft terms), the weights'
bytes after setup, and tokens/s. No torch.compile / Triton JIT on this path (the experts' fused
SwiGLU is megatron's, compiled on the first step: excluded by the warm-up steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ARMS = ("fp8", "bf16")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", choices=ARMS, help="run one arm in this process (the default runs both, each in its own)")
    p.add_argument("--tiny", action="store_true", help="tiny DeepSeek-V3 on CPU: proves the script runs")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (the first --dense of them dense)")
    p.add_argument("--dense", type=int, default=1)
    p.add_argument("--experts", type=int, default=32, help="routed experts per GPU (256 / EP)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (the recipe's pack_length)")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    return p.parse_args(argv)


def hf_config(args):
    from moe_sft.models import deepseek_v3

    if args.tiny:
        return deepseek_v3.tiny_hf_config(num_hidden_layers=args.layers, first_k_dense_replace=args.dense)
    from moe_sft.conversion.hf_source import load_hf_config
    from moe_sft.plan.shapes import MODELS_DIR

    _, full = load_hf_config(MODELS_DIR / "deepseek_v3")
    full.num_hidden_layers, full.first_k_dense_replace = args.layers, args.dense
    full.n_routed_experts = args.experts
    full.n_group, full.topk_group = 8, 4  # groups of 4 experts (DeepSeek-V3: 8 groups of 32)
    full.num_nextn_predict_layers = 0  # the recipe freezes MTP (not run)
    return full


def planner_bytes(args, hf, fp8: bool) -> dict:
    from moe_sft.plan import memory
    from moe_sft.plan.layout import Layout
    from moe_sft.plan.peft_memory import PeftPlan
    from moe_sft.plan.shapes import shape_from_hf_dict

    shape = shape_from_hf_dict(hf.to_dict(), name="reduced")
    lay = Layout(world=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1)
    train = memory.Training(
        tokens=args.tokens,
        micro_batches=args.micro_batches,
        recompute="full",
        precision="fp32" if args.tiny else "bf16",
        mtp_trained=False,
        peft=PeftPlan(rank=args.rank, target_modules=("attention", "experts"), fp8_base=fp8),
    )
    st = memory.stage_memory(shape, lay, 0, train)
    return dict(allocated=st.allocated, weights=st.weights, total=st.total)


def _build(args, hf, fp8: bool, device: str):
    """The model as the trainer assembles it (moe_sft/trainer/assemble.py) for the recipe's
    settings, plus the embedding hook full recompute of a frozen base needs."""
    import torch

    from moe_sft.config.layout import Layout
    from moe_sft.config.schema import DataConfig, ModelConfig, PeftConfig, TrainConfig, TrainerConfig
    from moe_sft.models import registry
    from moe_sft.peft import fp8_loading
    from moe_sft.trainer import assemble

    family = registry.family_by_name("deepseek_v3")
    cfg = TrainConfig(
        model=ModelConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        data=DataConfig(train_files=[], pack_length=args.tokens),  # the script makes its own batches
        trainer=TrainerConfig(output_dir="unused", max_steps=args.steps),
        peft=PeftConfig(
            method="lora", rank=args.rank, alpha=2 * args.rank, target_modules=["attention", "experts"], fp8_base=fp8
        ),
    )
    cfg.parallel.use_distributed_optimizer = True
    layout = Layout.from_config(cfg, 1, device=device).with_topk(family.shape(hf).topk)
    steps = (*assemble.PRE_WRAP, ("input requires grad", _hook_embeddings))
    precision = "fp32" if args.tiny else "bf16"
    hf_model = assemble.HFModel(family, hf, family.shape(hf))
    built = assemble.assemble(
        cfg, hf_model, layout, precision=precision, backend="torch", device=device, pre_wrap=steps
    )
    if fp8:
        fp8_loading.load_quantised(built.chunks, lambda keep: _random_fill(built.chunks, keep))
    torch.cuda.empty_cache() if device == "cuda" else None
    return built.model, built.tconfig


def _hook_embeddings(a) -> list[str]:
    for chunk in a.chunks:  # see _input_requires_grad
        chunk.embedding.register_forward_hook(_input_requires_grad)
    return []


def _input_requires_grad(module, args, output):
    """megatron's full recompute is a reentrant checkpoint: its output needs grad only when an input
    does, and a frozen embedding's output does not, so the adapters inside would get none (what HF's
    enable_input_require_grads does for the same reason)."""
    return output.requires_grad_(True) if not output.requires_grad else output


def _random_fill(chunks, keep) -> None:
    """Stands in for the checkpoint: the accepted base tensors get N(0, 0.02) (norms 1)."""
    import torch

    with torch.no_grad():
        for index, chunk in enumerate(chunks):
            for name, param in chunk.named_parameters():
                if ".adapter." not in name and keep(index, name):
                    param.fill_(1.0) if param.dim() == 1 else param.normal_(0, 0.02)


def _optimizer(model, tconfig, tiny: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    oc = OptimizerConfig(
        optimizer="adam", lr=1e-4, bf16=not tiny, params_dtype=tconfig.params_dtype, use_distributed_optimizer=True
    )
    return get_megatron_optimizer(oc, model)


def run_arm(args) -> dict:
    import torch

    from moe_sft.conversion.single_rank import init_single_rank
    from moe_sft.models.forward import packed_batch

    device = "cpu" if args.tiny else "cuda"
    init_single_rank("fp32" if args.tiny else "bf16")
    hf = hf_config(args)
    fp8 = args.arm == "fp8"
    model, tconfig = _build(args, hf, fp8, device)
    optimizer = _optimizer(model, tconfig, args.tiny)
    setup_bytes = torch.cuda.memory_allocated() if device == "cuda" else 0
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.micro_batches):
        doc = torch.randint(0, hf.vocab_size, (args.tokens + 1,), generator=g).tolist()
        tokens, positions, params = packed_batch([doc[:-1]], device)
        labels = torch.tensor([doc[1:]], device=device)
        batches.append((tokens, positions, params, labels))

    losses = []

    def step():
        total = 0.0
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        for tokens, positions, params, labels in batches:
            out = model[0](
                input_ids=tokens, position_ids=positions, attention_mask=None, packed_seq_params=params, labels=labels
            )
            loss = out.float().mean() / len(batches)
            loss.backward()
            total += loss.item()
        for chunk in model:
            chunk.finish_grad_sync()
        optimizer.step()
        losses.append(total)

    for _ in range(args.warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    plan = planner_bytes(args, hf, fp8)
    extra = _dequant_check(model) if fp8 and device == "cuda" else {}
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    gib = 2**30
    return dict(
        arm=args.arm,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        layers=args.layers,
        experts=args.experts if not args.tiny else hf.n_routed_experts,
        hidden=hf.hidden_size,
        tokens_per_step=args.tokens * args.micro_batches,
        tokens_per_s=args.tokens * args.micro_batches * args.steps / seconds,
        peak_allocated_gib=peak / gib if peak is not None else None,
        after_setup_gib=setup_bytes / gib,
        planner_allocated_gib=plan["allocated"] / gib,
        planner_weights_gib=plan["weights"] / gib,
        peak_vs_planner=(peak / plan["allocated"]) if peak is not None else None,
        losses=[round(x, 5) for x in losses],
        trainable_params=sum(p.numel() for c in model for p in c.parameters() if p.requires_grad),
        **extra,
    )


def _dequant_check(model) -> dict:
    """The Triton dequantisation equals the torch one bit for bit on one layer's experts' w1, and
    the time of each (ms per call)."""
    import torch

    from moe_sft.peft import fp8_base

    experts = next(m for _, m in fp8_base.fp8_modules(model[0].module) if hasattr(m, "weight1"))
    n, hidden = experts.num_local_experts, experts.config.hidden_size
    q, scale = experts.weight1.view(n, hidden, -1), experts.weight1_scale_inv
    out = {}
    for name, fn in (("triton", fp8_base.dequantize), ("torch", fp8_base.dequantize_torch)):
        fn(q, scale)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            w = fn(q, scale)
        torch.cuda.synchronize()
        out[f"dequant_w1_{name}_ms"] = (time.perf_counter() - start) / 5 * 1e3
        out[name] = w
    out["dequant_triton_equals_torch"] = bool(torch.equal(out.pop("triton"), out.pop("torch")))
    out["dequant_w1_shape"] = list(q.shape)
    return out


def main(argv=None) -> int:
    args = _args(argv)
    if args.arm:
        print("RESULT " + json.dumps(run_arm(args)), flush=True)
        return 0
    results = {}
    for arm in ARMS:
        argv_arm = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--arm", arm]
        env = {
            **os.environ,
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu.peft_fp8_bench", *argv_arm], capture_output=True, text=True, env=env
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            results[arm] = dict(error=f"exit {proc.returncode}")
            continue
        results[arm] = json.loads(lines[-1][len("RESULT ") :])
    summary = dict(bench="peft_fp8_base", **{arm: results[arm] for arm in ARMS})
    fp8, bf16 = results.get("fp8", {}), results.get("bf16", {})
    if fp8.get("peak_allocated_gib") and bf16.get("peak_allocated_gib"):
        summary["peak_saved_gib"] = bf16["peak_allocated_gib"] - fp8["peak_allocated_gib"]
        summary["fp8_speed_vs_bf16"] = fp8["tokens_per_s"] / bf16["tokens_per_s"]
    print(json.dumps(summary), flush=True)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
