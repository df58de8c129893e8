"""HF checkpoint → moe-sft dist checkpoint, streaming: peak memory is a few chunks, not the model.

The megatron model is built on the meta device (shapes, no storage); its sharded state dict tells
megatron's own `dist_checkpointing.save` what to write, and each tensor chunk is produced from
the HF tensors it needs just before it is written (streaming.py). Several processes can write
disjoint shares (`workers`). docs/conversion_at_scale.md has the measurements.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoConfig

from moe_sft.conversion import mapping, mcore_io, streaming
from moe_sft.conversion import workers as conversion_workers
from moe_sft.conversion.meta_model import meta_model
from moe_sft.conversion.hf_reader import CheckpointError, HFCheckpointReader
from moe_sft.conversion.streaming_reader import StreamingHFReader
from moe_sft.models import registry
from moe_sft.models.builder import ModelOptions, build_model_chunks, build_transformer_config
from moe_sft.runtime import device as rdevice, distributed

log = logging.getLogger(__name__)


def load_hf_config(path: Path, check_supported: bool = True):
    """(family, transformers config) of the config.json in `path`; `check_supported=False` leaves
    the family's support check to the caller (conversion first drops MTP layers the checkpoint
    lacks, mapping.drop_absent_mtp)."""
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
    if check_supported:
        family.check_supported(cfg)
    return family, cfg


def init_single_rank(precision: str = "fp32") -> None:
    """Runtime patches, a process group of one and megatron's parallel state (TP=PP=EP=1)."""
    choice = rdevice.RuntimeChoice("cpu", precision, "torch", ("offline tool",))
    if not torch.cuda.is_available():
        rdevice.prepare_runtime(choice)
    else:
        rdevice.prepare_runtime(rdevice.RuntimeChoice("cuda", precision, "torch", ()))
    distributed.init_process_group("cpu" if not torch.cuda.is_available() else "cuda")
    distributed.init_model_parallel()


def build_single_rank_model(family, hf_cfg, precision: str = "fp32"):
    """The GPTModel of `single_rank_model`, in an already initialised single-rank runtime."""
    opts = ModelOptions(precision=precision, backend="torch", device="cpu")
    config = build_transformer_config(family, hf_cfg, opts)
    return build_model_chunks(family, hf_cfg, config, opts)[0]


def single_rank_model(family, hf_cfg, precision: str = "fp32"):
    """A TP=PP=EP=1 GPTModel on CPU in this process (the exporter's and --verify's view)."""
    init_single_rank(precision)
    return build_single_rank_model(family, hf_cfg, precision)


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


@dataclass
class Job:
    """What a conversion needs to know about the HF checkpoint, checked before anything is built."""

    family: object
    hf_cfg: object
    reader: StreamingHFReader
    precision: str
    entries: list
    ctx: dict
    mtp_dropped: Optional[dict] = None  # {config field: MTP layers declared} when the checkpoint has none


def prepare(hf_path: str | Path) -> Job:
    """Read config + shard headers; the completeness gate for HF tensors runs here."""
    family, hf_cfg = load_hf_config(Path(hf_path), check_supported=False)
    declares_mtp = family.num_mtp_layers(hf_cfg) > 0
    if not declares_mtp:
        family.check_supported(hf_cfg)  # before any shard is opened
    reader = StreamingHFReader(hf_path, fp8_block=_fp8_block(hf_cfg))
    # A checkpoint saved by transformers declares MTP layers without their tensors: convert it
    # without MTP (set on hf_cfg, which everything below and the written hf/config.json follow).
    mtp_dropped = mapping.drop_absent_mtp(family, hf_cfg, reader.names())
    if declares_mtp:
        family.check_supported(hf_cfg)
    precision = _check_dtypes(reader)
    entries = mapping.expand(family, hf_cfg)
    mapping.check_hf_coverage(family, entries, reader.names(), hf_cfg, reader.empty_names())
    return Job(family, hf_cfg, reader, precision, entries, mapping.transform_context(family, hf_cfg),
               mtp_dropped)


def convert(hf_path: str | Path, out_path: str | Path, workers: int = 1,
            max_chunk_bytes: int = streaming.DEFAULT_MAX_CHUNK_BYTES, progress=None,
            nodes: int = 1, node_rank: int = 0, run_id: str = "local",
            node_timeout_s: float = 24 * 3600, overwrite: bool = False) -> dict:
    """Write the dist checkpoint + meta + HF side files; returns the meta dict (plus the bytes
    written and the seconds taken, which are not stored).

    Memory stays at a few chunks of `max_chunk_bytes`, or the largest tensor that must be made
    whole (fused QKV, a dense MLP's gate/up, an FP8-quantised weight), whatever the model size.
    `workers` processes per node write disjoint shares; `progress(done, total)` follows this
    process's. With `nodes` > 1 this call is one node's part (workers.py): node 0 publishes the
    checkpoint once all nodes have written; the others return after writing their share.
    A non-empty `out_path` is refused (mcore_io.OutputDirError, before anything is read) unless
    `overwrite`; an interrupted earlier conversion's `<out_path>.tmp` is replaced (or reused by
    the same `run_id`).
    """
    hf_path, out_path = Path(hf_path), Path(out_path)
    if workers < 1 or not 0 <= node_rank < nodes:
        raise ValueError(f"workers={workers}, node_rank={node_rank}, nodes={nodes}: use 1 or more "
                         "workers and a node rank in [0, nodes)")
    spec = conversion_workers.WorkerSpec(count=workers * nodes, index=node_rank * workers,
                                         hf_path=str(hf_path), nodes=nodes, run_id=run_id,
                                         node_timeout_s=node_timeout_s)
    started = time.time()
    tmp = out_path.with_name(out_path.name + ".tmp")
    if spec.index == 0:  # node 0 publishes: it alone decides what may be replaced
        load_hf_config(hf_path, check_supported=False)  # a wrong --hf-path is named first (config.json only)
        mcore_io.check_output(out_path, overwrite)
    conversion_workers.prepare_staging(tmp, spec)  # first: other nodes report failures in there
    job = None
    try:
        job = prepare(hf_path)
        if job.mtp_dropped and spec.index == 0:
            for field, count in job.mtp_dropped.items():
                log.warning("config.json declares %s=%d but the checkpoint holds no MTP tensors (saved "
                            "by transformers, which has no MTP module): converting without MTP",
                            field, count)
        model = meta_model(job.family, job.hf_cfg, job.precision)
        streaming.check_produced(job.entries, model.state_dict(keep_vars=True))  # before any write
        written = streaming.save_streaming(model, job.entries, job.reader, job.ctx, tmp, spec,
                                           max_chunk_bytes, progress)
        if spec.index > 0:  # another node's part: node 0 publishes
            return dict(written_bytes=written, seconds=time.time() - started, node_rank=node_rank)
        mcore_io.copy_hf_side_files(hf_path, tmp / mcore_io.HF_SUBDIR,
                                    {field: 0 for field in job.mtp_dropped or {}})
        meta = dict(family=job.family.name, model_type=job.hf_cfg.model_type,
                    vocab_size=job.hf_cfg.vocab_size, padded_vocab_size=job.ctx["padded_vocab_size"],
                    source=str(hf_path.resolve()), step=0, params_dtype=job.precision,
                    hf_tensors=len(job.reader.names()))
        if job.mtp_dropped:
            meta["mtp_dropped_from_config"] = job.mtp_dropped
        mcore_io.write_meta(tmp, meta)
        (tmp / conversion_workers.RUN_STAMP).unlink()
        mcore_io.commit_dir(tmp, out_path)
    except BaseException:
        if spec.index == 0:
            mcore_io.discard_staging(tmp)  # never leave a half checkpoint behind
        else:
            conversion_workers.report_failure(tmp, spec)  # node 0 raises it and cleans up
        raise
    finally:
        if job is not None:
            job.reader.close()
    seconds = time.time() - started
    log.info("converted %d HF tensors into %d megatron tensors: %.2f GB in %.1fs (%.0f MB/s)",
             len(job.reader.names()), len(job.entries), written / 1e9, seconds,
             written / 1e6 / max(seconds, 1e-9))
    meta["written_bytes"], meta["seconds"] = written, seconds
    return meta
