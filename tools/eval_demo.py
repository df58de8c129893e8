"""Exact-match accuracy of an HF model on the demo's held-out prompts, with plain transformers.

    python tools/eval_demo.py --model outputs/quickstart/run/hf [--data recipes/demo/data/eval.jsonl]

For each row the conversation up to its last assistant turn is rendered with the chat template
(generation prompt added), decoded greedily, and compared with that assistant turn's content.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def evaluate(model_dir: str, data_path: str, limit: int = 0) -> tuple[int, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A model written as its release is (Kimi-K2: `auto_map` and configuration_deepseek.py beside
    # the weights) loads through the modules it ships, as the release does.
    remote = "auto_map" in json.loads((Path(model_dir) / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=remote).eval()
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    correct = total = 0
    with open(data_path) as f:
        for line in f:
            messages = json.loads(line)["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt = tok.apply_chat_template(
                messages[:last], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            target = messages[last]["content"].strip()
            budget = len(tok(target)["input_ids"]) + 4
            with torch.no_grad():
                out = model.generate(
                    **prompt, max_new_tokens=budget, do_sample=False, eos_token_id=stop, pad_token_id=tok.pad_token_id
                )
            answer = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += answer.strip() == target
            total += 1
            if limit and total >= limit:
                break
    return correct, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory (e.g. <output_dir>/hf)")
    parser.add_argument("--data", default="recipes/demo/data/eval.jsonl")
    parser.add_argument("--limit", type=int, default=0, help="evaluate only the first N rows")
    args = parser.parse_args()
    correct, total = evaluate(args.model, args.data, args.limit)
    print(f"exact match: {correct}/{total} = {100.0 * correct / max(total, 1):.1f}% ({args.model})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
