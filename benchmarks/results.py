"""benchmark.json (every run and ceiling, merged across invocations) and its markdown tables."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from benchmarks.phases import PHASES

JSON_NAME, MD_NAME = "benchmark.json", "benchmark.md"


def environment() -> dict:
    import torch

    env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        host=platform.node(),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import megatron.core

        env["megatron_core"] = getattr(megatron.core, "__version__", "?")
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_count"] = torch.cuda.device_count()
    else:
        env["gpu"] = "none (CPU)"
    return env


def run_key(run: dict) -> str:
    return f"{run['arm']}|{run['model']}|L{run['layers']}|{run['gpus']}gpu|ep{run.get('ep', 1)}|{run['budget']}"


def load(out: Path) -> dict:
    path = Path(out) / JSON_NAME
    if path.is_file():
        return json.loads(path.read_text())
    return {"runs": [], "ceilings": [], "environment": {}}


def merge(out: Path, runs=(), ceilings=()) -> dict:
    """Add runs (replacing the same arm/model/layers/GPUs/budget) and ceilings; write JSON + markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = load(out)
    keep = {run_key(r): r for r in data["runs"]}
    for run in runs:
        keep[run_key(run)] = run
    data["runs"] = list(keep.values())
    new_kinds = {(c["model"], c["kind"], c["shape"]) for c in ceilings}
    data["ceilings"] = [c for c in data["ceilings"] if (c["model"], c["kind"], c["shape"]) not in new_kinds]
    data["ceilings"] += list(ceilings)
    data["environment"] = environment()
    (out / JSON_NAME).write_text(json.dumps(data, indent=1))
    (out / MD_NAME).write_text(markdown(data))
    return data


def _f(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _n(value) -> str:
    """1 decimal for GPU-sized numbers, 3 significant digits for the CPU smoke's tiny ones."""
    if value is None:
        return ""
    return f"{value:.1f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"


def markdown(data: dict) -> str:
    env = data.get("environment", {})
    cpu = env.get("gpu", "").startswith("none")
    head = (
        f"Device: {env.get('gpu', '?')}; torch {env.get('torch', '?')}, transformers "
        f"{env.get('transformers', '-')}, megatron-core {env.get('megatron_core', '-')}; {env.get('date', '')}."
    )
    lines = [head]
    if cpu:
        lines.append("**CPU SMOKE RUN (fp32, tiny shapes): checks the harness, NOT performance.**")
    lines += [
        "",
        "| arm | model | layers | GPUs (EP) | budget | tokens/step | step s (median) | tokens/s/GPU | "
        "model TFLOP/s/GPU (full SFT's) | hw TFLOP/s/GPU (executed) | MFU % | peak alloc / reserved GiB | "
        "loss first → last | status |",
        "|" + "---|" * 14,
    ]
    runs = sorted(data["runs"], key=lambda r: (r["model"], r["layers"], r["gpus"], r["budget"], r["arm"]))
    for r in runs:
        if r.get("status") != "ok":
            lines.append(
                f"| {r['arm']} | {r['model']} | {r['layers']} | {r['gpus']} ({r.get('ep', 1)}) | "
                f"{r['budget']} | | | | | | | | | {r.get('status')} |"
            )
            continue
        losses = r.get("losses") or [None]
        lines.append(
            f"| {r['arm']} | {r['model']} | {r['layers']} | {r['gpus']} ({r.get('ep', 1)}) | {r['budget']} | "
            f"{r['real_tokens_per_step']:,.0f} | {_f(r['step_seconds_median'], '.3f')} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {_n(r['tflops_per_gpu'])} | {_n(r.get('hw_tflops_per_gpu'))} | "
            f"{_n(r['mfu_pct'])} | "
            f"{r['peak_allocated_gib']:.1f} / {r['peak_reserved_gib']:.1f} | "
            f"{_f(losses[0], '.3f')} → {_f(losses[-1], '.3f')} | "
            + ("ok |" if not r.get("phase_error") else f"ok; phases failed: {r['phase_error']} |")
        )
    lines += lora_lines(runs) + ratio_lines(runs) + phase_tables(runs) + ceiling_table(data.get("ceilings", []))
    return "\n".join(lines) + "\n"


def is_lora(run: dict) -> bool:
    return run.get("executed_flop_kind", "").startswith("LoRA")


def run_line(r: dict) -> str:
    """One run in a line (the console's): tokens/s first; a LoRA run's executed FLOPs, then the
    model FLOPs of full SFT (MFU's units), each labelled."""
    if r.get("status") != "ok":
        return r.get("status", "")
    flop = (
        f"LoRA-executed {r['hw_tflops_per_gpu']:.1f} TFLOP/s/GPU (forward, input gradients, adapter weight "
        f"gradients), model FLOPs of full SFT {r['tflops_per_gpu']:.1f} TFLOP/s/GPU"
        if is_lora(r)
        else f"{r['tflops_per_gpu']:.1f} TFLOP/s/GPU"
    )
    return (
        f"{r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {flop}, MFU {r['mfu_pct']:.1f}%, "
        f"peak {r['peak_allocated_gib']:.1f} GiB"
    )


def lora_lines(runs: list[dict]) -> list[str]:
    """What each LoRA run's step executes, next to the model FLOPs of full SFT it is also given in."""
    out = [
        f"- {r['arm']} {r['model']} L{r['layers']} budget {r['budget']}: {r['tokens_per_s_per_gpu']:,.0f} "
        f"tokens/s/GPU; a LoRA step executes {r['executed_flop'] / r['steps'] / 1e12:.4g} TFLOP "
        f"({r['executed_flop_kind']}; {_n(r['hw_tflops_per_gpu'])} TFLOP/s/GPU), "
        f"{r['executed_flop'] / r['model_flop']:.2f}x the model FLOPs of full SFT on the same tokens "
        f"({r['model_flop'] / r['steps'] / 1e12:.4g} TFLOP; {_n(r['tflops_per_gpu'])} TFLOP/s/GPU, the MFU column's)"
        for r in runs
        if r.get("status") == "ok" and is_lora(r)
    ]
    return ([""] + out) if out else []


def ratio_lines(runs: list[dict]) -> list[str]:
    """tokens/s of each moe-sft arm over each other arm (a full-SFT arm over full-SFT arms only)."""
    out = []
    by = {}
    for r in runs:
        if r.get("status") == "ok" and r["gpus"] == 1:
            by.setdefault((r["model"], r["layers"], r["budget"]), {})[r["arm"]] = r
    for (model, layers, budget), arms in sorted(by.items()):
        for ours_name in [a for a in arms if a.startswith("moe-sft")]:
            ours = arms[ours_name]
            for name, other in arms.items():
                if name == ours_name:
                    continue
                if not is_lora(ours) and is_lora(other):  # moe-sft-lora / moe-sft is the line for those
                    continue
                same = "same tokens" if other["fed_digest"] == ours["fed_digest"] else "DIFFERENT tokens"
                out.append(
                    f"- {model} L{layers} budget {budget}: {ours_name} / {name} tokens/s = "
                    f"{ours['tokens_per_s_per_gpu'] / max(other['tokens_per_s_per_gpu'], 1e-9):.2f}x ({same})"
                )
    return ([""] + out) if out else []


def phase_tables(runs: list[dict]) -> list[str]:
    groups = {}
    for r in runs:
        if r.get("status") == "ok" and r.get("phases_ms"):
            groups.setdefault((r["model"], r["layers"], r["gpus"], r["budget"]), []).append(r)
    out = []
    for (model, layers, gpus, budget), group in sorted(groups.items()):
        out += [
            "",
            f"Phases, {model} L{layers}, {gpus} GPU(s), budget {budget}: ms per step "
            f"({group[0]['phase_source']}, forward + backward, rank 0; % of the profiled step; "
            "achieved TFLOP/s where a ceiling exists)",
            "",
            "| phase | " + " | ".join(r["arm"] for r in group) + " |",
            "|---|" + "---|" * len(group),
        ]
        for phase in PHASES:
            if not any(phase in r["phases_ms"] for r in group):
                continue
            cells = []
            for r in group:
                ms = r["phases_ms"].get(phase)
                step_ms = 1e3 * (r["profiled_step_seconds"] or 0)
                tf = r.get("phase_tflops", {}).get(phase)
                cells.append(
                    ""
                    if ms is None
                    else f"{ms:.1f} ({100 * ms / max(step_ms, 1e-9):.0f}%)" + (f", {_n(tf)} TFLOP/s" if tf else "")
                )
            out.append(f"| {phase} | " + " | ".join(cells) + " |")
        totals = [sum(r["phases_ms"].values()) for r in group]
        out.append("| **sum** | " + " | ".join(f"{t:.1f}" for t in totals) + " |")
        out.append(
            "| profiled step (wall) | "
            + " | ".join(f"{1e3 * (r['profiled_step_seconds'] or 0):.1f}" for r in group)
            + " |"
        )
        out.append(
            "| timed step (median, no profiler) | "
            + " | ".join(f"{1e3 * (r['step_seconds_median'] or 0):.1f}" for r in group)
            + " |"
        )
        out += host_sync_lines(group) + one_time_event_lines(group) + phase_detail_lines(group)
    return out


def phase_detail_lines(group: list[dict], top: int = 3) -> list[str]:
    """Per arm: each phase's costliest ops and the host's CPU time in it (profiled, so inflated),
    and the GPU's idle gaps by the kernel that ended them."""
    out = []
    for r in group:
        ops, idle = r.get("phase_ops") or {}, r.get("gpu_idle") or {}
        host = idle.get("host_ms_by_phase", {})
        for phase in PHASES:
            if phase in ops:
                top_ops = ", ".join(f"{name} {ms:.1f}" for name, ms in ops[phase][:top])
                out.append(
                    f"- {r['arm']} {phase}: {top_ops}" + (f"; host {host[phase]:.1f} ms" if phase in host else "")
                )
        if idle.get("by_next_kernel"):
            waits = ", ".join(f"{name[:60]} {ms:.1f}" for name, ms in idle["by_next_kernel"][:5])
            out.append(f"- {r['arm']}: GPU idle {idle['total_ms']:.1f} ms in the profiled step, before: {waits}")
    return ([""] + out) if out else []


def host_sync_lines(group: list[dict], top: int = 6) -> list[str]:
    """Per arm: host waits for the GPU in one step (torch's sync debug mode), busiest lines first."""
    out = []
    for r in group:
        sites = r.get("host_syncs")
        if sites is None:
            continue
        where = ", ".join(f"{site} x{n}" for site, n in list(sites.items())[:top])
        more = f", {len(sites) - top} more lines" if len(sites) > top else ""
        out.append(
            f"- {r['arm']}: {sum(sites.values())} host syncs in one step" + (f": {where}{more}" if sites else "")
        )
    return ([""] + out) if out else []


def one_time_event_lines(group: list[dict]) -> list[str]:
    """Per arm: timed steps that compiled a kernel or retried an allocation, with their seconds, and
    the throughput of the other timed steps (a step slow once, for a reason a longer run pays once)."""
    out = []
    for r in group:
        events = {int(index): counts for index, counts in (r.get("step_events") or {}).items()}
        if not events:
            continue
        seconds = r["step_seconds"]
        steps = "; ".join(
            f"step {i + 1} ({seconds[i]:.3f} s): " + ", ".join(f"{name} {n}" for name, n in counts.items())
            for i, counts in sorted(events.items())
        )
        line = f"- {r['arm']}: one-time work in timed steps: {steps}"
        rest = [i for i in range(len(seconds)) if i not in events]
        if rest and r.get("step_real_tokens"):
            rest_s = sum(seconds[i] for i in rest) * r.get("gpus", 1)
            line += (
                f". The other {len(rest)} steps: {sum(r['step_real_tokens'][i] for i in rest) / rest_s:,.0f} "
                f"tokens/s/GPU, {_n(sum(r['step_model_flop'][i] for i in rest) / rest_s / 1e12)} TFLOP/s/GPU"
            )
        out.append(line)
    return ([""] + out) if out else []


def ceiling_table(ceilings: list[dict]) -> list[str]:
    if not ceilings:
        return []
    out = [
        "",
        "Ceilings (kernels alone at the model's shapes; fwd+bwd = 3x forward FLOPs)",
        "",
        "| model | kernel | shape | ms | TFLOP/s |",
        "|---|---|---|---|---|",
    ]
    for c in ceilings:
        out.append(f"| {c['model']} | {c['kind']} | {c['shape']} | {c['ms']:.3f} | {_n(c['tflops'])} |")
    return out
