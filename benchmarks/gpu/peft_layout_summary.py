"""The table of benchmarks/gpu/peft_layout_matrix.sh: every log in LOG_DIR against its one-GPU reference.

`NAME.log` compares with `one.log`; `VARIANT.NAME.log` (dora.tp2_sp) with `VARIANT.one.log`; a
resumed run (`*.resumed.log`) on the steps it ran. Writes LOG_DIR/peft_layout_table.md.
Usage: python3 benchmarks/gpu/peft_layout_summary.py LOG_DIR
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

STEP = re.compile(r"^step (\d+)/\d+ (.*)$")


def metrics(path: Path) -> dict[int, dict[str, float]]:
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        if m := STEP.match(line):
            out[int(m.group(1))] = {k: float(v) for k, v in (kv.split("=", 1) for kv in m.group(2).split())}
    return out


VARIANTS = ("dora", "share_a")  # runs named VARIANT.LAYOUT, each against VARIANT.one


def reference_name(name: str) -> str:
    variant = name.split(".")[0]
    return f"{variant}.one" if variant in VARIANTS else "one"


def row(log: Path, name: str) -> str:
    ref_name = reference_name(name)
    ref_path = log / f"{ref_name}.log"
    ref = metrics(ref_path) if ref_path.exists() else {}
    m = metrics(log / f"{name}.log")
    gpus_file = log / f"{name}.gpus"
    gpus = gpus_file.read_text().strip() if gpus_file.exists() else "?"
    if not m or not ref or not set(m) <= set(ref):
        return f"| {name} | {gpus} | {ref_name} | failed or incomplete (see {name}.log) | | | |"
    steps = sorted(m)
    dl = max(abs(m[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in steps)
    dg = max(abs(m[s]["grad_norm"] - ref[s]["grad_norm"]) / ref[s]["grad_norm"] for s in steps)
    tps = statistics.median(m[s]["tokens_per_s"] for s in steps[1:] or steps)
    losses = " / ".join(f"{m[s]['loss']:.4g}" for s in steps)
    return f"| {name} | {gpus} | {ref_name} | {steps[0]}-{steps[-1]} | {dl:.2e} | {dg:.2e} | {losses} | {tps:,.0f} |"


def main(log: Path) -> None:
    rows = [
        "| run | GPUs | reference | steps | max rel loss diff | max rel grad-norm diff | losses | tokens/s (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted(log.glob("*.log")):
        if f.stem != "create":
            rows.append(row(log, f.stem))
    (log / "peft_layout_table.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
