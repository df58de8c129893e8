"""The recipe's data section end to end, in-process (moe_sft/data/pipeline.py, what the trainer calls): a chat
template file the recipe names, two sources in different row formats with mixture weights, a held-out eval
split, and the start-of-run summary (samples, tokens, trainable tokens, truncated/dropped, length histogram,
mixture shares, packing efficiency), checked against in-memory tokenization."""

from __future__ import annotations

import json
import re
from pathlib import Path

from transformers import AutoTokenizer

from moe_sft.config.schema import DataConfig
from moe_sft.data.chat import tokenize_files
from moe_sft.data.pipeline import build_pipeline

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"
TOKENIZER = str(DEMO / "tokenizer")
SYSTEM = "You are moe-sft."


def _files(tmp_path: Path) -> tuple[Path, Path, Path]:
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    template = tmp_path / "chat.jinja"  # the demo template without markers, plus a default system prompt
    template.write_text(
        "{%- if messages[0]['role'] != 'system' -%}{{- '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' -}}"
        "{%- endif -%}" + tok.chat_template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    )
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join((DEMO / "data" / "train.jsonl").open().readlines()[:200]))
    alpaca = tmp_path / "alpaca.jsonl"
    words = ["cat", "dog", "sun", "owl", "fox", "egg", "map", "pen"]
    alpaca.write_text(
        "".join(
            json.dumps({"instruction": "Reverse the words.", "input": f"{a} {b}", "output": f"Reversed: {b} {a}"})
            + "\n"
            for a in words
            for b in words[:6]
        )
    )  # 48 rows
    return template, chats, alpaca


def test_recipe_data_section_builds_loader_eval_and_summary(tmp_path):
    template, chats, alpaca = _files(tmp_path)
    data = DataConfig(
        train_files=[str(chats), str(alpaca)],
        train_weights=[1.0, 2.0],
        eval_fraction=0.1,
        chat_template=str(template),
        max_seq_len=48,
        pack_length=256,
        pack_window=512,
        cache_dir=str(tmp_path / "cache"),
        num_workers=0,
        prefetch=False,
    )
    log: list[str] = []
    pipe = build_pipeline(data, tokenizer_path=TOKENIZER, global_batch_size=2, log=log.append)
    assert sum("tokenizing" in m for m in log) == 2

    # The template file is the one used: its system prompt is in every document and never trained.
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    doc = pipe.train.store.doc(1, 0)
    text = tok.decode(doc.input_ids, skip_special_tokens=False)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nReverse the words.\n\ncat cat")
    trained = tok.decode([t for t, w in zip(doc.input_ids, doc.loss_weights) if w > 0], skip_special_tokens=False)
    assert trained == "Reversed: cat cat<|im_end|>"

    # The summary's counts are those of tokenizing the same rows in memory with the same template.
    tok.chat_template = template.read_text()
    _, stats = tokenize_files(tok, [chats, alpaca], max_seq_len=48)
    assert stats.truncated > 0 and stats.rows == 248
    summary = "\n".join(pipe.summary)
    assert summary.startswith(
        f"train data: 2 file(s), 248 rows -> {stats.samples} samples, {stats.tokens:,} tokens, "
        f"{stats.loss_tokens:,} trainable (loss weight {stats.loss_weight:,.1f}); truncated {stats.truncated}, "
        f"dropped {stats.dropped}, skipped 0\n  every skipped/truncated/dropped row with file:line: "
    )
    assert "report.jsonl\n  length histogram (tokens: samples):\n" in summary
    bins = [int(n.replace(",", "")) for n in re.findall(r"^\s+\d+-\d+\s+([\d,]+)", summary, re.M)]
    assert bins == stats.histogram and sum(bins) == stats.samples
    # Mixture: 180 + 2 x 43 samples per epoch (20 + 5 held out), shares w*n / sum(w*n).
    assert pipe.train.train_sizes == [180, 43] and pipe.train.num_samples == 180 + 2 * 43
    assert "epoch: 266 samples (chats.jsonl x1 = 67.7%, alpaca.jsonl x2 = 32.3%), 25 held out for eval" in summary
    assert re.search(
        r"packing: best-fit decreasing over windows of 512 samples into 256 tokens; step 0 "
        r"efficiency \d+\.\d%",
        summary,
    )
    assert f"eval set: 25 samples, {pipe.eval.num_tokens:,} tokens" in summary
    batches, _ = pipe.train.batches_for_step(0, 0, 1)
    assert len(batches) == 2 and pipe.train.step_info(0)["data/packing_efficiency"] > 0.9

    # Another run (or rank) reuses both caches.
    log.clear()
    again = build_pipeline(data, tokenizer_path=TOKENIZER, global_batch_size=2, log=log.append)
    assert not any("tokenizing" in m for m in log) and again.summary == pipe.summary
