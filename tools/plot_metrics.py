"""Plot a run's TensorBoard scalars to one SVG page (no plotting library needed).

    python tools/plot_metrics.py outputs/quickstart/run [--out run.svg] [--title "..."]

Reads `RUN/tensorboard` with TensorBoard's EventAccumulator and draws a grid of panels: loss
(and eval loss when logged), learning rate, grad norm, tokens/s, MFU (TFLOP/s per GPU where no
peak is known, e.g. on CPU), peak memory, and per MoE layer the max/mean expert load, dead
experts and routing entropy. Panels without data are left out. Metric definitions:
docs/telemetry.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from xml.sax.saxutils import escape

# (title, tag regex, y-axis floor at zero). A regex matching several tags draws one line each.
PANELS = (
    ("loss", r"train/loss|eval/loss", False),
    ("learning rate", r"train/lr", True),
    ("grad norm", r"train/grad_norm", True),
    ("tokens/s (all ranks)", r"train/tokens_per_s", True),
    ("MFU %", r"perf/mfu_pct", True),
    ("TFLOP/s per GPU", r"perf/tflops_per_gpu", True),
    ("peak memory GiB", r"memory/max_(allocated|reserved)_gib", True),
    ("max/mean expert load per layer", r"moe/layer_\d+/max_load_ratio", False),
    ("dead experts per layer", r"moe/layer_\d+/dead_experts", True),
    ("router entropy per layer (1 = uniform)", r"moe/layer_\d+/router_entropy", False),
    ("load-balancing loss", r"moe/.*load_balancing_loss", False),
)
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
W, H, PAD_L, PAD_B, PAD_T, PAD_R = 330, 210, 62, 30, 26, 12


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = run_dir / "tensorboard" if (run_dir / "tensorboard").is_dir() else run_dir
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _ticks(lo: float, hi: float, n: int = 3) -> list[str]:
    """n evenly spaced labels from lo to hi, with enough digits to tell them apart."""
    values = [lo + (hi - lo) * i / (n - 1) for i in range(n)]
    for digits in range(3, 8):
        labels = [f"{v:.0f}" if 1e3 <= abs(hi) < 1e7 else f"{v:.{digits}g}" for v in values]
        if len(set(labels)) == n:
            return labels
    return labels


def _layer_key(tag: str):
    m = re.search(r"layer_(\d+)", tag)
    return (int(m.group(1)) if m else -1, tag)


def panel(title: str, series: dict[str, list[tuple[int, float]]], floor_zero: bool, x0: int, y0: int) -> str:
    xs = [s for pts in series.values() for s, _ in pts]
    ys = [v for pts in series.values() for _, v in pts]
    lo, hi = (0.0 if floor_zero else min(ys)), max(ys)
    if hi == lo:
        hi, lo = hi + 0.5 * (abs(hi) or 1), lo - (0 if floor_zero else 0.5 * (abs(lo) or 1))
    s_lo, s_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B

    def px(step, value):
        return x0 + PAD_L + pw * (step - s_lo) / (s_hi - s_lo), y0 + PAD_T + ph * (1 - (value - lo) / (hi - lo))

    out = [
        f'<rect x="{x0 + PAD_L}" y="{y0 + PAD_T}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
        f'<text x="{x0 + W / 2}" y="{y0 + 16}" text-anchor="middle" font-weight="bold">{escape(title)}</text>',
        f'<text x="{x0 + PAD_L}" y="{y0 + H - 12}">{s_lo}</text>',
        f'<text x="{x0 + W - PAD_R}" y="{y0 + H - 12}" text-anchor="end">step {s_hi}</text>',
    ]
    for i, label in enumerate(_ticks(lo, hi)):
        y = y0 + PAD_T + ph * (1 - i / 2)
        out.append(f'<line x1="{x0 + PAD_L}" x2="{x0 + PAD_L + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{x0 + PAD_L - 4}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    for i, (tag, pts) in enumerate(sorted(series.items(), key=lambda kv: _layer_key(kv[0]))):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (px(s, v) for s, v in pts))
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        if len(series) > 1:
            label = re.sub(r"^.*?(layer_\d+).*$", r"\1", tag) if "layer_" in tag else tag.split("/")[-1]
            out.append(
                f'<text x="{x0 + PAD_L + 6 + 62 * (i % 4)}" y="{y0 + PAD_T + 14 + 12 * (i // 4)}" '
                f'fill="{color}">{escape(label)}</text>'
            )
    return "\n".join(out)


def render_svg(scalars: dict[str, list[tuple[int, float]]], title: str, columns: int = 3) -> str:
    panels = []
    for name, pattern, floor_zero in PANELS:
        series = {t: pts for t, pts in scalars.items() if re.fullmatch(pattern, t) and pts}
        if series:
            panels.append((name, series, floor_zero))
    if not panels:
        raise SystemExit("no known metrics in the event files (is this a moe-sft run directory?)")
    rows = -(-len(panels) // columns)
    width, height = columns * W, rows * H + 30
    body = [
        panel(name, series, floor, (i % columns) * W, 30 + (i // columns) * H)
        for i, (name, series, floor) in enumerate(panels)
    ]
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">\n<rect width="100%" height="100%" fill="white"/>\n'
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14" font-weight="bold">'
        f"{escape(title)}</text>\n" + "\n".join(body) + "\n</svg>\n"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="trainer.output_dir of a run (or its tensorboard/ dir)")
    ap.add_argument("--out", type=Path, help="output .svg (default: RUN/metrics.svg)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    out = args.out or args.run_dir / "metrics.svg"
    if out.suffix != ".svg":
        print(f"--out {out}: this tool writes SVG (no plotting library needed); use a .svg name", file=sys.stderr)
        return 2
    out.write_text(render_svg(read_scalars(args.run_dir), args.title or f"moe-sft run {args.run_dir}"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
