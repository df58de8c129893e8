"""The HF checkpoint a conversion reads: its config.json (family and transformers config, also
what the trainer loads), its shards (checked dtypes, FP8 block shape) and the checked `Job`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig

from moe_sft.conversion import completeness, composite, mapping
from moe_sft.conversion.hf_reader import CheckpointError, HFCheckpointReader
from moe_sft.conversion.streaming_reader import StreamingHFReader
from moe_sft.models import registry
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)


def load_hf_config(path: Path, check_supported: bool = True):
    """(family, transformers config of the language model) of the config.json in `path`;
    `check_supported=False` leaves the family's support check to the caller (conversion first
    drops MTP layers the checkpoint lacks, mapping.drop_absent_mtp). A multimodal checkpoint's
    language model is its text config (`load_hf_source` gives the whole)."""
    family, cfg, _ = load_hf_source(path, check_supported)
    return family, cfg


def load_hf_source(path: Path, check_supported: bool = True):
    """`load_hf_config` and the checkpoint's composite view (composite.CompositeSource: a
    multimodal checkpoint holding the family's language model), or None."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{path}: no config.json; point the path at the directory holding config.json and *.safetensors"
        )
    # Check model_type before AutoConfig: a type transformers does not know (a newer family) must
    # still get the registry's error listing the supported types, not transformers' upgrade hint.
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file}: not valid JSON ({err})") from err
    registry.family_for_model_type(model_type, source=str(config_file))
    try:
        cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as err:
        raise CheckpointError(f"{path}/config.json: cannot be read by transformers ({err})") from err
    family = registry.family_for_model_type(cfg.model_type, source=f"{path}/config.json")
    whole = composite.of(family, cfg)
    if whole is not None:
        cfg = whole.spec.text_config(cfg)
    if check_supported:
        family.check_supported(cfg)
    return family, cfg, whole


def fp8_block(hf_cfg) -> tuple[int, int]:
    """Block shape of FP8 scales from `quantization_config.weight_block_size` (DeepSeek: 128x128)."""
    quant = getattr(hf_cfg, "quantization_config", None) or {}
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    return tuple(quant.get("weight_block_size", (128, 128)))


def check_dtypes(reader: HFCheckpointReader) -> str:
    per_file = reader.dtypes()
    floats = {d for ds in per_file.values() for d in ds if d in ("F32", "BF16", "F16")}
    if len(floats) > 1:
        detail = "; ".join(f"{f}: {sorted(d)}" for f, d in sorted(per_file.items()))
        raise CheckpointError(
            f"{reader.path}: shards mix floating dtypes ({detail}); re-save the checkpoint in one dtype"
        )
    return "bf16" if floats == {"BF16"} else "fp32"


@dataclass
class Job:
    """What a conversion needs to know about the HF checkpoint, checked before anything is built."""

    family: object
    hf_cfg: object
    reader: StreamingHFReader
    precision: str
    entries: list
    ctx: dict
    mtp_dropped: dict | None = None  # {config field: MTP layers declared} when the checkpoint has none
    copies_absent: list[str] = field(default_factory=list)  # mapping.without_copies: HF copies not stored
    whole: composite.CompositeSource | None = None  # a multimodal checkpoint holding the language model
    carried: dict[str, list[str]] = field(default_factory=dict)  # {what: names} carried through untouched


def remote_code_note(path: Path, family) -> str | None:
    """What a checkpoint with its own modeling code (config.json's `auto_map`, *.py files next to
    it: Kimi-K2, MiniMax-M2 releases) gets: a line saying that code is not run, or None."""
    raw = json.loads((Path(path) / "config.json").read_text())
    files = sorted(p.name for p in Path(path).glob("*.py"))
    if not raw.get("auto_map") and not files:
        return None
    named = ", ".join(([f"auto_map {sorted(raw['auto_map'])}"] if raw.get("auto_map") else []) + files)
    return (
        f"{path} ships its own modeling code ({named}): moe-sft reads config.json and the safetensors "
        f"weights only and builds the {family.name} family's megatron model; that code is never run "
        "(no trust_remote_code)"
    )


def prepare(hf_path: str | Path) -> Job:
    """Read config + shard headers; the completeness gate for HF tensors runs here."""
    family, hf_cfg, whole = load_hf_source(Path(hf_path), check_supported=False)
    if note := remote_code_note(Path(hf_path), family):
        log.info(note)
    declares_mtp = family.num_mtp_layers(hf_cfg) > 0
    if not declares_mtp:
        family.check_supported(hf_cfg)  # before any shard is opened
    # a multimodal config.json keeps quantization_config at its top, not in text_config
    reader = StreamingHFReader(hf_path, fp8_block=fp8_block(whole.config if whole is not None else hf_cfg))
    # A checkpoint saved by transformers declares MTP layers without their tensors: convert it
    # without MTP (set on hf_cfg, which everything below and the written hf/config.json follow).
    rename = whole.hf_name if whole is not None else (lambda name: name)
    mtp_dropped = mapping.drop_absent_mtp(family, hf_cfg, reader.names(), rename)
    if declares_mtp:
        family.check_supported(hf_cfg)
    precision = check_dtypes(reader)
    entries = mapping.expand(family, hf_cfg)
    if whole is not None:  # the language model's names as the multimodal checkpoint spells them
        entries = whole.rename(entries)
    # Copies of the embedding / LM head in MTP layers hold nothing: GLM-4.6 stores none of them.
    copies_absent = mapping.absent_copies(entries, reader.names())
    entries = mapping.without_copies(entries, copies_absent)
    carried = whole.carried(reader.names() - {n for e in entries for n in e.hf}) if whole is not None else {}
    completeness.check_hf_coverage(
        family, entries, reader.names(), hf_cfg, reader.empty_names(), set(composite.carried_names(carried))
    )
    ctx = mapping.transform_context(family, hf_cfg)
    return Job(family, hf_cfg, reader, precision, entries, ctx, mtp_dropped, copies_absent, whole, carried)
