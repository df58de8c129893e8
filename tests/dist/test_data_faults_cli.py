"""Data faults through `python -m moe_sft.train` (issue 42): one `error:` line naming the file and the
fix, exit code 2, no traceback: a tokenizer without a chat template, and a data cache cut short."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.dist.test_train_errors import _train

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"


def _one_error_line(proc, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    for needle in needles:
        assert needle in line, line
    return line


def test_tokenizer_without_a_chat_template(tmp_path):
    tok = tmp_path / "base_tokenizer"
    shutil.copytree(DEMO / "tokenizer", tok)
    (tok / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    proc = _train(tmp_path, f"data.tokenizer_path={tok}", f"data.cache_dir={tmp_path / 'cache'}")
    _one_error_line(proc, f"tokenizer {tok} has no chat template", "data.tokenizer_path", "data.chat_template")


def test_truncated_data_cache(tmp_path):
    cache = tmp_path / "cache"
    # The quickstart's train file cached with the quickstart's data settings, then cut short.
    from moe_sft.config.schema import DataConfig
    from moe_sft.data.pipeline import build_pipeline

    data = DataConfig(
        train_files=[str(DEMO / "data" / "train.jsonl")],
        cache_dir=str(cache),
        num_workers=0,
        max_seq_len=256,
        pack_length=1024,
    )
    built = build_pipeline(data, tokenizer_path=str(DEMO / "tokenizer"), global_batch_size=1, log=lambda m: None)
    (directory,) = [c.dir for c in built.train.store.caches]
    tokens = directory / "tokens.u32"
    tokens.write_bytes(tokens.read_bytes()[:1000])
    proc = _train(tmp_path, f"data.cache_dir={cache}", "data.eval_files=[]", "trainer.eval_interval=0")
    _one_error_line(proc, f"data cache {directory} is damaged: tokens.u32 holds 1,000 bytes", "delete that directory")
