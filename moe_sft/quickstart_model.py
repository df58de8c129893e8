"""Create the quickstart's tiny random HF checkpoint (Qwen3-MoE unless `--family` names another
registered family; the demo tokenizer) and convert it.

Run as a module in its own process (the trainer's rank 0 does this when
`model.create_tiny_if_missing=true` and the paths are absent):

    python -m moe_sft.quickstart_model --hf-path DIR --mcore-path DIR --tokenizer recipes/demo/tokenizer \
        [--family gpt_oss]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

# Decoder layers of the quickstart's tiny model (`--num-layers`).
NUM_LAYERS = 2


def create_tiny_hf(
    hf_path: Path, tokenizer_dir: Path, seed: int = 0, family: str = "qwen3_moe", **config_overrides
) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    from moe_sft.models import registry

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tiny = registry.family_by_name(family)
    cfg = tiny.tiny_hf_config(vocab_size=len(tokenizer), **config_overrides)
    cfg.bos_token_id = None
    cfg.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = tiny.hf_model_class(cfg)
    tmp = hf_path.with_name(hf_path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    if tiny.remote_code is not None:  # the modules the config's auto_map names, as the release ships
        for module in sorted(tiny.remote_code.glob("*.py")):
            shutil.copy2(module, tmp / module.name)
    tokenizer.save_pretrained(str(tmp))
    GenerationConfig(eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, do_sample=False).save_pretrained(
        str(tmp)
    )
    tmp.rename(hf_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hf-path", required=True, type=Path)
    parser.add_argument("--mcore-path", required=True, type=Path)
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--num-layers", type=int, default=NUM_LAYERS, help="decoder layers of the tiny model")
    parser.add_argument("--family", default="qwen3_moe", help="a moe_sft.models.registry family name")
    parser.add_argument("--experts", type=int, help="routed experts (the family's tiny default if unset)")
    parser.add_argument("--top-k", type=int, help="experts per token (the family's tiny default if unset)")
    args = parser.parse_args()
    if not (args.hf_path / "config.json").is_file():
        args.hf_path.parent.mkdir(parents=True, exist_ok=True)
        routing = {k: v for k, v in (("num_experts", args.experts), ("num_experts_per_tok", args.top_k)) if v}
        create_tiny_hf(args.hf_path, args.tokenizer, family=args.family, num_hidden_layers=args.num_layers, **routing)
        print(f"created tiny {args.family} at {args.hf_path}")
    if not (args.mcore_path / "moe_sft_meta.json").is_file():
        from moe_sft.conversion.convert import convert

        convert(args.hf_path, args.mcore_path)
        print(f"converted {args.hf_path} -> {args.mcore_path}")


if __name__ == "__main__":
    main()
