"""Model shapes for the planner, read from an HF config.json as plain JSON (no transformers, no torch).

A recipe names its model through the checkpoint it trains (`model.mcore_path/hf/config.json`, or
`model.hf_path/config.json`) or, when no checkpoint is at hand (planning on a laptop, before the
conversion job), through `model.hf_config`: a name under recipes/models/ (the public config.json
of each production model ships there) or a path. When both exist they must describe the same model.

Defaults for absent keys are transformers' own (Qwen3MoeConfig, MixtralConfig, DeepseekV3Config);
tests/cpu/test_plan.py checks the shapes against the families' TransformerConfig translation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moe_sft.config.schema import ConfigError

MODELS_DIR = Path(__file__).resolve().parents[2] / "recipes" / "models"
VOCAB_DIVISOR = 128  # = moe_sft.models.builder.VOCAB_DIVISOR (padded vocab, split evenly over TP)
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "mixtral", "qwen3_moe")  # = models.registry (tested)


@dataclass(frozen=True)
class MLA:
    """DeepSeek multi-latent attention sizes (q_lora None: plain q projection)."""

    q_lora: Optional[int]
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    num_layers: int
    hidden: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool
    ffn: int                       # dense MLP intermediate size (dense layers only)
    num_experts: int
    topk: int
    moe_ffn: int
    shared_ffn: int                # shared-expert intermediate size (0: none)
    moe_layers: tuple[bool, ...]   # per decoder layer: MoE (True) or dense MLP
    mtp_layers: int
    tie_embeddings: bool
    mla: Optional[MLA] = None

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // VOCAB_DIVISOR) * VOCAB_DIVISOR

    @property
    def family(self) -> str:
        return self.model_type

    def describe(self) -> str:
        attn = (f"MLA q_lora={self.mla.q_lora} kv_lora={self.mla.kv_lora} heads={self.num_heads}"
                if self.mla else f"GQA {self.num_heads}/{self.num_kv_heads} heads x {self.head_dim}")
        dense = self.num_layers - sum(self.moe_layers)
        shared = f" + shared {self.shared_ffn}" if self.shared_ffn else ""
        return (f"{self.name} ({self.model_type}): {self.num_layers} layers ({dense} dense), hidden "
                f"{self.hidden}, {attn}, {self.num_experts} experts top-{self.topk} x {self.moe_ffn}"
                f"{shared}, vocab {self.vocab}" + (f", {self.mtp_layers} MTP" if self.mtp_layers else ""))


def _get(d: dict, *names, default=None):
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


def shape_from_hf_dict(d: dict, name: str = "model") -> ModelShape:
    """ModelShape of a supported HF config (dict from config.json)."""
    mt = d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{name}: model_type={mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    layers, hidden, heads = int(d["num_hidden_layers"]), int(d["hidden_size"]), int(d["num_attention_heads"])
    experts = int(_get(d, "num_experts", "num_local_experts", "n_routed_experts", default=0))
    common = dict(name=name, model_type=mt, num_layers=layers, hidden=hidden, vocab=int(d["vocab_size"]),
                  num_heads=heads, num_experts=experts, topk=int(d.get("num_experts_per_tok") or 0),
                  tie_embeddings=bool(d.get("tie_word_embeddings", False)))
    if mt == "deepseek_v3":
        first_dense = int(d.get("first_k_dense_replace", 0) or 0)
        mla = MLA(q_lora=d.get("q_lora_rank"), kv_lora=int(d["kv_lora_rank"]), qk_nope=int(d["qk_nope_head_dim"]),
                  qk_rope=int(d["qk_rope_head_dim"]), v_head=int(d["v_head_dim"]))
        return ModelShape(**common, num_kv_heads=heads, head_dim=mla.qk_nope + mla.qk_rope, qk_norm=True,
                          ffn=int(d["intermediate_size"]), moe_ffn=int(d["moe_intermediate_size"]),
                          shared_ffn=int(d.get("n_shared_experts") or 0) * int(d["moe_intermediate_size"]),
                          moe_layers=tuple(experts > 0 and i >= first_dense for i in range(layers)),
                          mtp_layers=int(d.get("num_nextn_predict_layers") or 0), mla=mla)
    head_dim = int(d.get("head_dim") or hidden // heads)
    kv = int(d.get("num_key_value_heads") or heads)
    if mt == "mixtral":
        return ModelShape(**common, num_kv_heads=kv, head_dim=head_dim, qk_norm=False,
                          ffn=int(d["intermediate_size"]), moe_ffn=int(d["intermediate_size"]), shared_ffn=0,
                          moe_layers=(True,) * layers, mtp_layers=0)
    mlp_only = set(d.get("mlp_only_layers") or [])
    step = int(d.get("decoder_sparse_step") or 1)
    return ModelShape(**common, num_kv_heads=kv, head_dim=head_dim, qk_norm=True,
                      ffn=int(d["intermediate_size"]), moe_ffn=int(d["moe_intermediate_size"]), shared_ffn=0,
                      moe_layers=tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0
                                       for i in range(layers)), mtp_layers=0)


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
    raise ConfigError(f"model.hf_config={ref!r} is neither a model known to moe-sft ({', '.join(known_models())}) "
                      f"nor a config.json / directory holding one; fix the name or the path")


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
    candidates = [(Path(p) / sub / "config.json", f"model.{key}") for key, p, sub in
                  (("mcore_path", m.mcore_path, "hf"), ("hf_path", m.hf_path, "")) if p]
    found = [(path, key) for path, key in candidates if path.is_file()]
    declared = load_shape(m.hf_config) if m.hf_config else None
    problems: list[str] = []
    if found:
        path, key = found[0]
        shape = shape_from_hf_dict(read_config_json(path), name=path.parent.name if key == "model.hf_path"
                                   else Path(getattr(m, key.split(".")[1])).name)
        if declared is not None:
            problems += shape_mismatch(shape, declared[0], f"{key}={getattr(m, key.split('.')[1])!r}",
                                       f"model.hf_config={m.hf_config!r}")
        return shape, str(path), problems
    if declared is not None:
        return declared[0], str(declared[1]), problems
    if m.create_tiny_if_missing:
        return shape_from_hf_dict(_tiny_quickstart_config(cfg), name="quickstart-tiny"), "quickstart tiny model", []
    raise ConfigError("no HF config for the planner: model.mcore_path / model.hf_path hold no config.json here; "
                      f"set model.hf_config to one of {', '.join(known_models())} or to a config.json path")


_COMPARED = ("model_type", "num_layers", "hidden", "vocab", "num_heads", "num_kv_heads", "num_experts",
             "topk", "moe_ffn", "mtp_layers")


def shape_mismatch(found: ModelShape, expected: ModelShape, found_where: str, expected_where: str) -> list[str]:
    """One message per differing field, naming both sources and the fix."""
    diffs = [f"{f}={getattr(found, f)} (expected {getattr(expected, f)})" for f in _COMPARED
             if getattr(found, f) != getattr(expected, f)]
    if not diffs:
        return []
    return [f"{found_where} holds another model than {expected_where}: {', '.join(diffs)}; "
            f"point the checkpoint path at a conversion of the right model or fix model.hf_config"]
