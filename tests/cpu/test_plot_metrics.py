"""tools/plot_metrics.py reads a run's TensorBoard events and draws one SVG panel per metric
group, one line per series (per MoE layer), with the values placed on the right scale."""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import plot_metrics  # noqa: E402

NS = "{http://www.w3.org/2000/svg}"


def test_plot_from_event_files(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "run" / "tensorboard"))
    for step in range(1, 6):
        writer.add_scalar("train/loss", 5.0 - step, step)
        writer.add_scalar("train/lr", 1e-3, step)
        for layer in range(3):
            writer.add_scalar(f"moe/layer_{layer}/max_load_ratio", 1.0 + layer + step / 10, step)
    writer.close()
    out = tmp_path / "plot.svg"
    assert plot_metrics.main([str(tmp_path / "run"), "--out", str(out), "--title", "t"]) == 0
    root = ET.parse(out).getroot()
    texts = [t.text for t in root.iter(NS + "text")]
    assert {"loss", "learning rate", "max/mean expert load per layer"} <= set(texts)
    assert "grad norm" not in texts  # no data, no panel
    assert {"layer_0", "layer_1", "layer_2"} <= set(texts)  # a legend entry per layer
    lines = [p.get("points") for p in root.iter(NS + "polyline")]
    assert len(lines) == 1 + 1 + 3
    # the loss panel: 5 points, falling (SVG y grows downwards), first at the top, last at the bottom
    ys = [float(p.split(",")[1]) for p in lines[0].split()]
    assert len(ys) == 5 and ys == sorted(ys) and ys[0] < ys[-1]
    top, bottom = plot_metrics.PAD_T + 30, plot_metrics.H - plot_metrics.PAD_B + 30
    assert ys[0] == pytest.approx(top) and ys[-1] == pytest.approx(bottom)
    assert re.search(r">4<", out.read_text()) and re.search(r">0<", out.read_text())  # loss axis 0..4


def test_refuses_non_svg_output(tmp_path):
    assert plot_metrics.main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
