"""What a model family declares: config translation, GPTModel arguments, shape, the weight
mapping table, and defaults. Everything model-specific is here; nothing outside models/ branches
on a model type.

Each family file (qwen3_moe.py, ...) builds one `Family`. The mapping table is declarative:
`Rule(mcore, hf, transform, layers)` with `{layer}` / `{expert}` placeholders; the generic engine
in moe_sft/conversion/mapping.py expands and applies it in both directions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moe_sft.models.shape import ModelShape
from moe_sft.models.transforms import IDENTITY, Transform


@dataclass(frozen=True)
class Rule:
    """One megatron tensor ↔ the HF tensor(s) it is made of."""

    mcore: str  # megatron state_dict name (TP=PP=EP=1 module layout)
    hf: tuple[str, ...]  # HF names; with "{expert}", repeated for every expert in order
    transform: Transform = IDENTITY
    # none (global tensor) | all | dense | moe | mtp | linear_attention | full_attention (decoder
    # layers by their mixer: Family.is_linear_attention_layer)
    layers: str = "none"


@dataclass(frozen=True)
class Composite:
    """A multimodal release whose checkpoint holds the family's language model beside other parts
    (Qwen3.5's vision tower): the language model is converted and trained, the rest is carried
    through untouched and written back at export (moe_sft/conversion/composite.py)."""

    model_type: str  # config.json's model_type of the whole checkpoint
    hf_model_class: type  # what loads the export (no missing or unexpected keys)
    text_config: Callable[[object], object]  # the whole config (object or config.json dict) -> the LM's
    # (text-only checkpoint's HF name prefix, the same tensor's prefix in this checkpoint); a name
    # matching none is the same in both (Qwen3.5: `lm_head.weight`)
    renames: tuple[tuple[str, str], ...]
    # {regex: what it is, in words}: the tensors carried through (a tensor neither mapped, dropped
    # nor carried fails the completeness gate)
    carried: dict[str, str]
    tiny_hf_config: Callable[..., object]  # the tiny model's whole config (tests, demos)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    hf_config_class: type
    hf_model_class: type
    check_supported: Callable[[object], None]  # raises UnsupportedConfigError naming the field
    # HF config -> megatron TransformerConfig fields (MLA: its rope too, MLATransformerConfig's).
    transformer_config_kwargs: Callable[[object], dict]
    # HF config -> GPTModel's own arguments (position embedding, rotary base and percent, tied
    # embeddings, max sequence length); the builder adds vocab, pipeline stage and specs.
    gpt_model_kwargs: Callable[[object], dict]
    # HF config (a config.json dict or a transformers config) -> ModelShape; pure (no torch), so
    # the planner reads shapes with it (models/shape.py).
    shape: Callable[..., ModelShape]
    rules: Callable[[object], list[Rule]]
    is_moe_layer: Callable[[object, int], bool]  # the one rule; shape() and the config use it
    tiny_hf_config: Callable[..., object]
    # A random legal HF config of the family's whole space (rng: random.Random), small enough to
    # run on a CPU: the parity sweep (moe_sft/conversion/parity.py) draws from it.
    sample_hf_config: Callable[..., object] | None = None
    dropped: tuple[str, ...] = ()  # regexes of HF tensors deliberately not loaded
    # HF config -> {regex: why}: tensors this config declares that are deliberately not loaded
    # (MiniMax-M2's MTP modules, `model.layers.{N + k}.*`); conversion logs each reason it uses.
    dropped_for_config: Callable[[object], dict[str, str]] | None = None
    training_defaults: dict = field(default_factory=dict)
    transform_context: Callable[[object], dict] | None = None
    # Multi-token-prediction layers after the decoder (DeepSeek-V3's num_nextn_predict_layers).
    # Each one holds a full decoder layer: the family's per-layer rules are reused for it.
    num_mtp_layers: Callable[[object], int] = lambda cfg: 0
    # The HF config field holding that count: a checkpoint saved by transformers declares MTP
    # layers it does not hold (transformers' model has none), and conversion sets it to 0.
    mtp_config_field: str | None = None
    # Where the HF checkpoint keeps MTP layer k's decoder layer, "{mtp}" standing for k; None:
    # `model.layers.{N + k}.` (DeepSeek-V3's layout). Qwen3-Next / Qwen3.5: "mtp.layers.{mtp}.".
    mtp_layer_hf_prefix: str | None = None
    # The directory of the *.py modules the release's config.json `auto_map` names (remote code
    # for trust_remote_code), as moe-sft writes them (models/remote_code/): the tiny model ships
    # them as the release does, and conversion and export carry them (mcore_io.remote_code_files).
    remote_code: Path | None = None
    # Hybrid models (Qwen3-Next, Qwen3.5): decoder layer i's mixer is Gated DeltaNet, not attention.
    is_linear_attention_layer: Callable[[object, int], bool] = lambda cfg, i: False
    # A multimodal checkpoint type holding this family's language model (Qwen3.5's VL release).
    composite: Composite | None = None


class UnsupportedConfigError(ValueError):
    """An HF config field moe-sft cannot honour; the message names the field and the value."""
