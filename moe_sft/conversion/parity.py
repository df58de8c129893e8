"""Conversion checked against transformers on one HF config: the parity sweep's unit of work.

For a config (drawn by the family's `sample_hf_config`, or a user's config.json) this builds
transformers' own model, perturbs every parameter and persistent buffer (so no weight is at an
initial value that could hide a mapping error: norms at 1, a zero expert bias), saves it in bf16,
converts it, and checks:
- fp32 logits of the converted model equal transformers' (packed THD documents vs each document
  alone) on documents long enough to exercise the rotary positions (and YaRN past its original
  length);
- the export of the converted checkpoint is bit-identical to the source tensors;
- transformers loads the export with no missing or unexpected tensor.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from moe_sft.conversion.convert import convert
from moe_sft.conversion.export import export, load_model_from_checkpoint
from moe_sft.conversion.verify import LOGIT_TOLERANCE, VERIFY_LENGTHS
from moe_sft.models.forward import packed_logits
from moe_sft.runtime import cpu_compat


@dataclass
class ParityResult:
    family: str
    seed: int
    config: dict
    max_logit_diff: float = float("nan")
    round_trip_exact: bool = False
    export_loads: bool = False
    error: str = ""
    details: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.error and self.max_logit_diff <= LOGIT_TOLERANCE and self.round_trip_exact and self.export_loads


def sample_vocab(rng: random.Random) -> int:
    """A vocabulary that is not a multiple of 128 (megatron pads it; the padding must not leak)."""
    vocab = rng.randint(130, 700)
    return vocab + 1 if vocab % 128 == 0 else vocab


@torch.no_grad()
def perturbed_hf_model(family, cfg, seed: int):
    """transformers' model with every parameter and persistent buffer moved off its init value."""
    g = torch.Generator().manual_seed(seed)
    with cpu_compat.suspended():
        torch.manual_seed(seed)
        model = family.hf_model_class(cfg).eval()
    persistent = {name for name, _ in model.named_buffers() if _is_persistent(model, name)}
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]
    for name, tensor in tensors:
        if tensor.numel() == 0:
            continue
        noise = torch.randn(tensor.shape, generator=g, dtype=torch.float32)
        if tensor.dim() == 1:  # norm weights, biases, the expert bias: around 1 / 0 with spread
            base = 1.0 if name.endswith("norm.weight") else 0.0
            tensor.copy_(base + 0.3 * noise)
        else:
            tensor.add_(0.5 * tensor.float().std().clamp(min=0.02) * noise)
    return model


def _is_persistent(model, buffer_name: str) -> bool:
    owner_name, _, attr = buffer_name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    return attr not in owner._non_persistent_buffers_set


def _tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _documents(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in VERIFY_LENGTHS]


def check_config(family, cfg, seed: int, work_dir: Path) -> ParityResult:
    """Build, save (bf16), convert, compare, export: every check of the module docstring."""
    result = ParityResult(family.name, seed, cfg.to_diff_dict())
    try:
        _run_checks(family, cfg, seed, Path(work_dir), result)
    except Exception as err:  # a sweep reports every failing config, it does not stop at one
        result.error = f"{type(err).__name__}: {err}"
    return result


def _run_checks(family, cfg, seed: int, work: Path, result: ParityResult) -> None:
    hf_dir, mcore_dir, out_dir = work / "hf", work / "mcore", work / "export"
    model = perturbed_hf_model(family, cfg, seed).to(torch.bfloat16)
    with cpu_compat.suspended():
        model.save_pretrained(str(hf_dir))
    del model
    convert(hf_dir, mcore_dir)
    docs = _documents(cfg.vocab_size, seed)
    with cpu_compat.suspended(), torch.no_grad():
        reference = family.hf_model_class.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        refs = [reference(torch.tensor([d])).logits[0].float() for d in docs]
    del reference
    ours = packed_logits(load_model_from_checkpoint(mcore_dir, precision="fp32").eval(), docs, cfg.vocab_size)
    result.max_logit_diff = max((r - o).abs().max().item() for r, o in zip(refs, ours))
    result.details["logit_scale"] = max(r.abs().max().item() for r in refs)
    export(mcore_dir, out_dir, dtype="bf16")
    before, after = _tensors(hf_dir), _tensors(out_dir)
    result.round_trip_exact = set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
    if not result.round_trip_exact:
        result.details["round_trip"] = (
            sorted(set(before) ^ set(after)) or sorted(k for k in before if not torch.equal(before[k], after[k]))[:10]
        )
    with cpu_compat.suspended():
        _, info = family.hf_model_class.from_pretrained(str(out_dir), output_loading_info=True)
    problems = {
        k: sorted(v) for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    result.export_loads = not problems
    if problems:
        result.details["export_loading"] = problems


def sweep(family, seeds, keep_failures: Path | None = None):
    """check_config on the family's config drawn from each seed; yields ParityResult."""
    for seed in seeds:
        rng = random.Random(f"{family.name}-{seed}")
        cfg = family.sample_hf_config(rng, sample_vocab(rng))
        work = Path(tempfile.mkdtemp(prefix=f"parity_{family.name}_{seed}_"))
        result = check_config(family, cfg, seed, work)
        if not result.passed and keep_failures is not None and (work / "hf").is_dir():
            shutil.copytree(work / "hf", keep_failures / f"{family.name}_{seed}", dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        yield result


def result_json(result: ParityResult) -> str:
    return json.dumps(dict(asdict(result), passed=result.passed), default=str)
