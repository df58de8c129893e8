"""Launch `moe_sft.train` under torchrun (gloo on CPU) from a test, and read its console log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"^step (\d+)/(\d+) (.*)$")
# torchrun sets these for its children; a test itself launched under torchrun must not leak them
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}


def torchrun_cmd(nproc: int, overrides, recipe: str = "quickstart", faults: str | None = None) -> list[str]:
    """`faults`: run tests/fault_injection.py with this fault spec instead of `-m moe_sft.train`."""
    entry = ["-m", "moe_sft.train"] if faults is None else [str(REPO / "tests" / "fault_injection.py"), faults]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *entry,
        "--config-path",
        "recipes",
        "--config-name",
        recipe,
        *overrides,
    ]


def torchrun(
    nproc: int,
    overrides,
    recipe: str = "quickstart",
    check: bool = True,
    timeout: int = 900,
    env: dict | None = None,
    faults: str | None = None,
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        torchrun_cmd(nproc, overrides, recipe, faults),
        cwd=REPO,
        env={**clean_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def torchrun_cases(
    nproc: int, cases, recipe: str = "quickstart", timeout: int = 1800, env: dict | None = None
) -> list[str]:
    """Several runs (one list of overrides each) of one world size in one launch
    (tests/dist/multi_run.py), in order; each run's rank-0 stdout. The launch must succeed."""
    import json
    import tempfile

    from tests.dist.multi_run import CASE_MARK

    argvs = [["--config-path", "recipes", "--config-name", recipe, *map(str, overrides)] for overrides in cases]
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps(argvs))
        worker = str(REPO / "tests" / "dist" / "multi_run.py")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", worker]
        cmd.append(str(spec))
        proc = subprocess.run(
            cmd, cwd=REPO, env={**clean_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    logs = proc.stdout.split(CASE_MARK)[1:]
    assert [int(log.split("\n", 1)[0]) for log in logs] == list(range(len(cases))), proc.stdout[-3000:]
    return [log.split("\n", 1)[1] if "\n" in log else "" for log in logs]


def step_metrics(stdout: str) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} from the rank-0 console lines `step N/M loss=... lr=...`."""
    out = {}
    for line in stdout.splitlines():
        if m := STEP_LINE.match(line):
            out[int(m.group(1))] = {k: float(v) for k, v in (kv.split("=", 1) for kv in m.group(3).split())}
    return out


def losses(stdout: str) -> dict[int, float]:
    return {step: metrics["loss"] for step, metrics in step_metrics(stdout).items()}


def make_tiny_model(tmp: Path, **config_overrides) -> Path:
    """The quickstart's tiny Qwen3-MoE (demo tokenizer) in tmp/hf, converted into tmp/mcore."""
    from moe_sft.conversion.convert import convert
    from moe_sft.quickstart_model import create_tiny_hf

    create_tiny_hf(tmp / "hf", REPO / "recipes/demo/tokenizer", **config_overrides)
    convert(tmp / "hf", tmp / "mcore")
    return tmp


def tiny_run_overrides(
    model_dir: Path, output_dir: Path, max_steps: int, *extra: str, global_batch_size: int = 2
) -> list[str]:
    """A run of the converted model in `model_dir` (hf/ and mcore/, e.g. make_tiny_model) writing to
    `output_dir`, logging every step, no export."""
    return [
        f"trainer.max_steps={max_steps}",
        "trainer.log_interval=1",
        f"trainer.global_batch_size={global_batch_size}",
        "trainer.export_hf_at_end=false",
        f"trainer.output_dir={output_dir}",
        f"model.hf_path={model_dir / 'hf'}",
        f"model.mcore_path={model_dir / 'mcore'}",
        "model.create_tiny_if_missing=false",
        *extra,
    ]
