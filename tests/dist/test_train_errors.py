"""Bad input to `python -m moe_sft.train` gives one clear line and exit code 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.dist.launch import REPO, clean_env


def _train(tmp: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = clean_env()
    cmd = [
        sys.executable,
        "-m",
        "moe_sft.train",
        "--config-path",
        "recipes",
        "--config-name",
        "quickstart",
        f"trainer.output_dir={tmp / 'run'}",
        f"model.hf_path={tmp / 'hf'}",
        f"model.mcore_path={tmp / 'mcore'}",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_unknown_recipe_key_names_the_fix(tmp_path):
    proc = _train(tmp_path, "trainer.max_step=3")
    assert proc.returncode == 2
    assert "trainer.max_steps" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_jsonl_row_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad.write_text(json.dumps(good) + "\n" + json.dumps({"conversation": []}) + "\n")
    proc = _train(tmp_path, f"data.train_files=[{bad}]")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{bad}:2" in proc.stderr and "messages" in proc.stderr
    assert "Traceback" not in proc.stderr
