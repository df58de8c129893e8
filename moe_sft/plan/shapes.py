"""Model shapes for the planner, read from an HF config.json as plain JSON by the family's pure shape().

A recipe names its model through the checkpoint it trains (`model.mcore_path/hf/config.json`, or
`model.hf_path/config.json`) or, when no checkpoint is at hand (planning on a laptop, before the
conversion job), through `model.hf_config`: a name under recipes/models/ (the public config.json
of each production model ships there) or a path. When both exist they must describe the same model.

The shape is the family's (`Family.shape`, moe_sft/models/); tests/cpu/test_plan.py checks the
shapes against the families' TransformerConfig translation.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_sft.config.schema import ConfigError
from moe_sft.models import registry
from moe_sft.models.shape import ModelShape

MODELS_DIR = Path(__file__).resolve().parents[2] / "recipes" / "models"
SUPPORTED_MODEL_TYPES = tuple(registry.supported_model_types())


def shape_from_hf_dict(d: dict, name: str = "model") -> ModelShape:
    """ModelShape of a supported HF config (dict from config.json): its family's shape()."""
    mt = d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{name}: model_type={mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return registry.family_for_model_type(mt).shape(d, name=name)


def known_models() -> list[str]:
    return sorted(p.parent.name for p in MODELS_DIR.glob("*/config.json"))


def _config_file(ref: str) -> Path:
    """A model name under recipes/models/, a config.json path, or a directory holding one."""
    path = Path(ref)
    if (MODELS_DIR / ref / "config.json").is_file():
        return MODELS_DIR / ref / "config.json"
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file():
        return path
    raise ConfigError(
        f"model.hf_config={ref!r} is neither a model known to moe-sft ({', '.join(known_models())}) "
        f"nor a config.json / directory holding one; fix the name or the path"
    )


def read_config_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the HF config ({err})") from None


def load_shape(ref: str) -> tuple[ModelShape, Path]:
    path = _config_file(ref)
    name = path.parent.name if path.name == "config.json" else path.stem
    return shape_from_hf_dict(read_config_json(path), name=name), path


def _tiny_quickstart_config(cfg) -> dict:
    """The quickstart recipe creates its tiny model on first run: plan with the same config
    (moe_sft.quickstart_model: qwen3_moe.tiny_hf_config sized to the tokenizer)."""
    from tokenizers import Tokenizer

    from moe_sft.models import qwen3_moe

    tokenizer_dir = Path(cfg.data.tokenizer_path or MODELS_DIR.parent / "demo" / "tokenizer")
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    return qwen3_moe.tiny_hf_config(vocab_size=vocab).to_dict()


def resolve_model(cfg) -> tuple[ModelShape, str, list[str]]:
    """(shape, where it came from, problems) for a TrainConfig.

    Order: the checkpoint's own config (mcore_path/hf, then hf_path), else model.hf_config, else the
    quickstart's tiny model. A checkpoint whose config disagrees with model.hf_config is a problem.
    """
    m = cfg.model
    candidates = [
        (Path(p) / sub / "config.json", f"model.{key}")
        for key, p, sub in (("mcore_path", m.mcore_path, "hf"), ("hf_path", m.hf_path, ""))
        if p
    ]
    found = [(path, key) for path, key in candidates if path.is_file()]
    declared = load_shape(m.hf_config) if m.hf_config else None
    problems: list[str] = []
    if found:
        path, key = found[0]
        shape = shape_from_hf_dict(
            read_config_json(path),
            name=path.parent.name if key == "model.hf_path" else Path(getattr(m, key.split(".")[1])).name,
        )
        if declared is not None:
            problems += shape_mismatch(
                shape, declared[0], f"{key}={getattr(m, key.split('.')[1])!r}", f"model.hf_config={m.hf_config!r}"
            )
        return shape, str(path), problems
    if declared is not None:
        return declared[0], str(declared[1]), problems
    if m.create_tiny_if_missing:
        return shape_from_hf_dict(_tiny_quickstart_config(cfg), name="quickstart-tiny"), "quickstart tiny model", []
    raise ConfigError(
        "no HF config for the planner: model.mcore_path / model.hf_path hold no config.json here; "
        f"set model.hf_config to one of {', '.join(known_models())} or to a config.json path"
    )


_COMPARED = (
    "model_type",
    "num_layers",
    "hidden",
    "vocab",
    "num_heads",
    "num_kv_heads",
    "num_experts",
    "topk",
    "moe_ffn",
    "mtp_layers",
)


def shape_mismatch(found: ModelShape, expected: ModelShape, found_where: str, expected_where: str) -> list[str]:
    """One message per differing field, naming both sources and the fix."""
    diffs = [
        f"{f}={getattr(found, f)} (expected {getattr(expected, f)})"
        for f in _COMPARED
        if getattr(found, f) != getattr(expected, f)
    ]
    if not diffs:
        return []
    return [
        f"{found_where} holds another model than {expected_where}: {', '.join(diffs)}; "
        f"point the checkpoint path at a conversion of the right model or fix model.hf_config"
    ]
