"""Serve a family's quickstart export with vLLM and compare its greedy outputs with transformers'.

    python tools/vllm_check.py --family kimi_k2 --work /tmp/vllm_check --vllm-python /work/vllm-venv/bin/python \
        [--prompts 50] [--new-tokens 16] [--export DIR] [--rope yarn] [--device cuda]

Not a CI test (vLLM is too heavy for CI); results are recorded in docs/families.md. Without
`--export`, it makes the family's tiny quickstart model (moe_sft.quickstart_model, written as the
release is: config fields, auto_map, modules), converts it and exports the conversion (fp32, no
training): what a user's export holds, with untrained weights. DeepSeek-type families (MLA) get
kv_lora_rank 512 and qk_rope_head_dim 64, the only MLA sizes vLLM's CPU build runs (their sum 576);
`--rope yarn` gives them DeepSeek-V3's YaRN rope. Prompts: the demo's held-out conversations
rendered with the chat template. transformers (this venv) and vLLM (`--vllm-python`: its own venv;
CPU build: `VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1`; fp32, enforce_eager, trust_remote_code)
both decode `--new-tokens` tokens greedily, ignoring EOS; a sequence matches when every token is
the same. MiniMax-M2 needs vLLM's GPU build (`--device cuda`): the CPU router scores by softmax only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

MLA_SIZES = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
TOKENIZER = Path("recipes/demo/tokenizer")
EVAL_DATA = Path("recipes/demo/data/eval.jsonl")

_VLLM = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, prompts_file, out_file, new_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompts = json.load(open(prompts_file))
llm = LLM(model=model, dtype="float32", enforce_eager=True, trust_remote_code=True, max_model_len=512, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
json.dump([list(o.outputs[0].token_ids) for o in outs], open(out_file, "w"))
"""


def make_export(family: str, work: Path, rope: str) -> Path:
    from moe_sft.conversion.convert import convert
    from moe_sft.conversion.export import export
    from moe_sft.quickstart_model import create_tiny_hf

    overrides = {}
    if family in ("deepseek_v3", "kimi_k2"):
        overrides.update(MLA_SIZES)
        if rope == "yarn":
            overrides["rope_parameters"] = dict(DEEPSEEK_YARN)
        elif rope == "default":
            overrides["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    hf, mcore, out = work / "hf", work / "mcore", work / "export"
    if not (hf / "config.json").is_file():
        create_tiny_hf(hf, TOKENIZER, family=family, **overrides)
    if not (mcore / "moe_sft_meta.json").is_file():
        convert(hf, mcore)
    if not (out / "config.json").is_file():
        export(mcore, out, dtype="fp32")
    return out


def prompts(model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [json.loads(line)["messages"] for line in EVAL_DATA.read_text().splitlines()[:count]]
    out = []
    for messages in rows:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out.append(
            tok.apply_chat_template(messages[:last], add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
    return out


@torch.no_grad()
def transformers_greedy(model_dir: Path, token_prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from moe_sft.models import registry

    # transformers' own classes (moe_sft's registry makes kimi_k2 known here): the reference our
    # conversion matches; tests/cpu/test_kimi_k2.py loads exports through their shipped modules
    family = registry.family_for_model_type(json.loads((model_dir / "config.json").read_text())["model_type"])
    model = family.hf_model_class.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    for ids in token_prompts:
        x = torch.tensor([ids])
        for _ in range(new_tokens):  # plain greedy decoding over the whole sequence: no EOS, no cache
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        outs.append(x[0, len(ids) :].tolist())
    return outs


def vllm_greedy(
    vllm_python: str, model_dir: Path, token_prompts, new_tokens: int, work: Path, device: str
) -> list[list[int]]:
    (work / "prompts.json").write_text(json.dumps(token_prompts))
    env = dict(os.environ)
    if device == "cpu":
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [
        vllm_python,
        "-c",
        _VLLM,
        str(model_dir),
        str(work / "prompts.json"),
        str(work / "vllm.json"),
        str(new_tokens),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    (work / "vllm.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        tail = (run.stdout + run.stderr).strip().splitlines()[-15:]
        raise SystemExit(f"vLLM failed on {model_dir} (log: {work / 'vllm.log'}):\n" + "\n".join(tail))
    return json.loads((work / "vllm.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--export", type=Path, help="an existing export to serve instead of the tiny model's")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rope", choices=("family", "default", "yarn"), default="family")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="which vLLM build --vllm-python has")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = args.export or make_export(args.family, args.work, args.rope)
    token_prompts = prompts(model_dir, args.prompts)
    ours = transformers_greedy(model_dir, token_prompts, args.new_tokens)
    theirs = vllm_greedy(args.vllm_python, model_dir, token_prompts, args.new_tokens, args.work, args.device)
    same = sum(a == b for a, b in zip(ours, theirs))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, theirs)]
    diverged = sorted(i for i in first if i is not None)
    print(
        f"{args.family} ({model_dir}): {same}/{len(ours)} greedy sequences of {args.new_tokens} tokens "
        f"identical in vLLM and transformers"
        + (f"; first differing token positions {diverged[:10]}" if diverged else "")
    )
    return 0 if same == len(ours) else 1


if __name__ == "__main__":
    sys.exit(main())
