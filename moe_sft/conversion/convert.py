"""HF checkpoint → moe-sft dist checkpoint, streaming one HF tensor at a time."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from moe_sft.conversion import mapping, mcore_io
from moe_sft.conversion.hf_reader import CheckpointError, HFCheckpointReader
from moe_sft.models import registry
from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config
from moe_sft.runtime import compat, device as rdevice, distributed

log = logging.getLogger(__name__)


def load_hf_config(path: Path):
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json; point the path at the directory holding "
                              "config.json and *.safetensors")
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
    family.check_supported(cfg)
    return family, cfg


def single_rank_model(family, hf_cfg, precision: str = "fp32"):
    """A TP=PP=EP=1 GPTModel on CPU in this process (the converter's and exporter's view)."""
    choice = rdevice.RuntimeChoice("cpu", precision, "torch", ("offline tool",))
    if not torch.cuda.is_available():
        rdevice.prepare_runtime(choice)
    else:
        rdevice.prepare_runtime(rdevice.RuntimeChoice("cuda", precision, "torch", ()))
    distributed.init_process_group("cpu" if not torch.cuda.is_available() else "cuda")
    distributed.init_model_parallel()
    opts = ModelOptions(precision=precision, backend="torch", device="cpu")
    config = build_transformer_config(family, hf_cfg, opts)
    return build_model_chunks(family, hf_cfg, config, opts)[0]


def _fp8_block(hf_cfg) -> tuple[int, int]:
    """Block shape of FP8 scales from `quantization_config.weight_block_size` (DeepSeek: 128x128)."""
    quant = getattr(hf_cfg, "quantization_config", None) or {}
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    return tuple(quant.get("weight_block_size", (128, 128)))


def _check_dtypes(reader: HFCheckpointReader) -> str:
    per_file = reader.dtypes()
    floats = {d for ds in per_file.values() for d in ds if d in ("F32", "BF16", "F16")}
    if len(floats) > 1:
        detail = "; ".join(f"{f}: {sorted(d)}" for f, d in sorted(per_file.items()))
        raise CheckpointError(f"{reader.path}: shards mix floating dtypes ({detail}); re-save the "
                              "checkpoint in one dtype")
    return "bf16" if floats == {"BF16"} else "fp32"


def convert(hf_path: str | Path, out_path: str | Path) -> dict:
    """Write the dist checkpoint + meta + HF side files; returns the meta dict."""
    from megatron.core import dist_checkpointing

    hf_path, out_path = Path(hf_path), Path(out_path)
    family, hf_cfg = load_hf_config(hf_path)
    reader = HFCheckpointReader(hf_path, fp8_block=_fp8_block(hf_cfg))
    precision = _check_dtypes(reader)
    entries = mapping.expand(family, hf_cfg)
    mapping.check_hf_coverage(family, entries, reader.names(), hf_cfg)
    model = single_rank_model(family, hf_cfg, precision)
    ctx = mapping.transform_context(family, hf_cfg)
    started = time.time()
    mapping.load_hf_into_state(entries, reader.get, ctx, model.state_dict())
    tmp = mcore_io.staging_dir(out_path)
    tmp.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(tmp))
    mcore_io.copy_hf_side_files(hf_path, tmp / mcore_io.HF_SUBDIR)
    meta = dict(family=family.name, model_type=hf_cfg.model_type, vocab_size=hf_cfg.vocab_size,
                padded_vocab_size=ctx["padded_vocab_size"], source=str(hf_path.resolve()),
                step=0, params_dtype=precision, hf_tensors=len(reader.names()))
    mcore_io.write_meta(tmp, meta)
    mcore_io.commit_dir(tmp, out_path)
    log.info("converted %d HF tensors into %d megatron tensors in %.1fs", len(reader.names()),
             len(entries), time.time() - started)
    return meta


def verify(hf_path: str | Path, mcore_path: str | Path, sequences: list[list[int]] | None = None,
           tolerance: float = 1e-3) -> float:
    """Max |logit difference| between HF's model and ours on a few token sequences (fp32, CPU)."""
    from moe_sft.conversion.export import load_model_from_checkpoint
    from moe_sft.models.forward import packed_logits

    family, hf_cfg = load_hf_config(Path(hf_path))
    if sequences is None:
        g = torch.Generator().manual_seed(0)
        sequences = [torch.randint(0, hf_cfg.vocab_size, (n,), generator=g).tolist() for n in (17, 33, 9)]
    with compat.suspended(), torch.no_grad():
        hf_model = family.hf_model_class.from_pretrained(str(hf_path), dtype=torch.float32).eval()
        refs = [hf_model(torch.tensor([seq])).logits[0].float() for seq in sequences]
    del hf_model
    model = load_model_from_checkpoint(mcore_path, precision="fp32").eval()
    ours = packed_logits(model, sequences, hf_cfg.vocab_size)
    return max((ref - mine).abs().max().item() for ref, mine in zip(refs, ours))
