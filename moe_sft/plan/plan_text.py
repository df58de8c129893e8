"""Text of a Plan: what `python -m moe_sft.plan` and `trainer.dry_run=true` print."""

from __future__ import annotations

from moe_sft.plan import hardware, memory
from moe_sft.plan.layout import rank_roles
from moe_sft.plan.params import active_params_per_token, total_params

G = memory.GIB


def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _size(n: float) -> str:
    return f"{n / G:.1f} GiB" if abs(n) >= G / 10 else f"{n / 2**20:.1f} MiB"


def _layers(stage) -> str:
    ids = stage.layers
    if not ids:
        return "-"
    return f"{len(ids)} ({ids[0]}-{ids[-1]})" if ids == list(range(ids[0], ids[-1] + 1)) else str(len(ids))


def format_plan(plan) -> str:
    cfg, s, lay, gpu = plan.cfg, plan.shape, plan.layout, plan.gpu
    hw = cfg.hardware
    out = [
        f"model: {s.describe()}",
        f"  config: {plan.shape_source}; {_b(total_params(s))} parameters, "
        f"{_b(active_params_per_token(s))} active per token",
        f"hardware: {lay.world} GPUs ({hw.nodes} node(s) x {hw.gpus_per_node} planned) of {gpu.name}, "
        f"{plan.gpu_mem_gib:.1f} GiB each",
        f"layout: {lay.short()}",
    ]
    out += [f"kernels: {k}" for k in hardware.kernels(gpu, cfg.model.backend)]
    for title, items in (("ERRORS", plan.errors), ("warnings", plan.warnings)):
        if items:
            out.append(f"{title}:")
            out += [f"  - {e}" for e in items]
    if plan.errors and not plan.stages:
        return "\n".join(out)
    t = plan.train
    tokens = cfg.trainer.global_batch_size * cfg.data.pack_length
    out.append(
        f"batch: {cfg.trainer.global_batch_size} packed micro-batches x {cfg.data.pack_length} tokens = "
        f"{tokens:,} tokens per step; {t.micro_batches} micro-batches per data-parallel rank; "
        f"conversations up to {cfg.data.max_seq_len} tokens"
    )
    rec = t.recompute or "none"
    if t.recompute == "full":
        rec += f" ({t.recompute_method}, {t.recompute_num_layers} layer(s) per unit)"
    out.append(
        f"recompute: {rec}; optimizer: {'distributed' if t.distributed_optimizer else 'replicated'}"
        + (f", {t.offload_fraction:.0%} of its Adam state on the CPU" if t.offload_fraction else "")
    )
    out += _peft_lines(plan)
    out += _memory_table(plan)
    big = plan.largest
    margin = plan.gpu_mem_gib * G - big.total
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    out.append(
        f"largest: stage {big.pp_rank}: {big.total / G:.1f} GiB of {plan.gpu_mem_gib:.1f} GiB -> {verdict} "
        f"(margin {margin / G:+.1f} GiB, {margin / (plan.gpu_mem_gib * G):+.0%})"
    )
    choices = ", ".join(f"{k} {_size(a)} (total {_size(tot)})" for k, (a, tot) in plan.by_recompute.items())
    out.append(f"activations of stage {big.pp_rank} by recompute choice: {choices}")
    if any(st.optimizer_offloaded for st in plan.stages):
        out.append(
            f"host memory for offloaded optimizer state: {max(st.optimizer_offloaded for st in plan.stages) / G:.1f} "
            f"GiB per GPU (x {cfg.hardware.gpus_per_node} per node)"
        )
    th = plan.throughput
    if active_params_per_token(s) < 1e8:
        out.append("throughput: not estimated (a model this small is bound by kernel launches, not FLOPs)")
        return "\n".join(out)
    out.append(
        f"throughput (ESTIMATE, not measured): ~{th['tokens_per_s']:,.0f} tokens/s "
        f"({th['per_gpu']:,.0f} per GPU), ~{tokens / th['tokens_per_s']:.1f} s per step; basis: "
        f"{th['flops_per_token'] / 1e9:.1f} GFLOP per token (forward + backward of {cfg.data.max_seq_len}-token "
        f"documents, the telemetry's formula) at an assumed {hardware.ASSUMED_MFU:.0%} of {gpu.bf16_dense_tflops:.0f} "
        f"bf16 TFLOP/s, x{th['recompute_factor']:.2f} recompute, x{th['bubble']:.2f} pipeline bubble"
    )
    return "\n".join(out)


def _peft_lines(plan) -> list[str]:
    """What an adapted run (peft.method != none) holds on its largest stage."""
    p, big = plan.cfg.peft, plan.largest
    if big.peft is None:
        return []
    st = big.peft
    base = (
        f"base frozen in FP8 (peft.fp8_base): {_b(st.fp8_values)} values in e4m3 + {_size(4 * st.fp8_scales)} of "
        f"128x128 block scales, dequantised per GEMM (up to {_size(st.dequant_peak)} at once, in 'work'); "
        f"the rest (embedding, LM head, norms, routers) bf16"
        if p.fp8_base
        else "base frozen in bf16 (peft.fp8_base=true would hold its linears and experts in FP8)"
    )
    return [
        f"peft: {p.method} rank {p.rank} on {', '.join(p.target_modules)}: {_b(st.adapters)} adapter parameters on "
        f"stage {big.pp_rank}'s GPUs ({_b(st.dense + st.expert)} trainable), their grads fp32, Adam sharded",
        f"  {base}",
    ]


def _memory_table(plan) -> list[str]:
    small = plan.largest.allocated < G  # tiny models: MiB, not 0.0 GiB everywhere
    unit, scale = ("MiB", 2**20) if small else ("GiB", G)
    head = (
        "stage",
        "layers",
        "params",
        "weights",
        "grads",
        "optim",
        "activ",
        "work",
        "logits",
        "p2p",
        "allocated",
        "+overhead",
    )
    rows = [head]
    for st in plan.stages:
        rows.append(
            (
                str(st.pp_rank) + (" *" if st is plan.largest else ""),
                _layers(st),
                _b(st.params.total),
                *(
                    f"{v / scale:.1f}"
                    for v in (
                        st.weights,
                        st.grads,
                        st.optimizer,
                        st.activations,
                        st.working,
                        st.logits,
                        st.pipeline_buffers,
                        st.allocated,
                        st.total,
                    )
                ),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        f"memory per GPU in {unit} by pipeline stage (activ = saved activations x in-flight micro-batches; "
        "work = backward working set; +overhead = allocated x "
        f"{1 + plan.largest.fragmentation:.2f} + {memory.RUNTIME_OVERHEAD_GIB} GiB CUDA context/NCCL; * = largest):"
    ]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return lines


def format_roles(plan) -> list[str]:
    return [
        "rank roles (TP/PP/CP/DP attention coordinates; EP/ETP/expert-DP coordinates; layers per "
        "virtual stage; routed experts held):"
    ] + ["  " + line for line in rank_roles(plan.shape, plan.layout, plan.cfg.hardware.gpus_per_node)]
