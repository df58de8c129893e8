"""HF checkpoint → moe-sft dist checkpoint, streaming: peak memory is a few chunks, not the model.

The megatron model is built on the meta device (shapes, no storage); its sharded state dict tells
megatron's own `dist_checkpointing.save` what to write, and each tensor chunk is produced from
the HF tensors it needs just before it is written (streaming.py). Several processes can write
disjoint shares (`workers`). docs/conversion_at_scale.md has the measurements.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from moe_sft.conversion import completeness, composite, mapping, mcore_io, streaming
from moe_sft.conversion import workers as conversion_workers
from moe_sft.conversion.hf_source import load_hf_config, prepare
from moe_sft.conversion.meta_model import meta_model
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)


def convert(
    hf_path: str | Path,
    out_path: str | Path,
    workers: int = 1,
    max_chunk_bytes: int = streaming.DEFAULT_MAX_CHUNK_BYTES,
    progress=None,
    nodes: int = 1,
    node_rank: int = 0,
    run_id: str = "local",
    node_timeout_s: float = 24 * 3600,
    overwrite: bool = False,
) -> dict:
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
        raise ValueError(
            f"workers={workers}, node_rank={node_rank}, nodes={nodes}: use 1 or more "
            "workers and a node rank in [0, nodes)"
        )
    spec = conversion_workers.WorkerSpec(
        count=workers * nodes,
        index=node_rank * workers,
        hf_path=str(hf_path),
        nodes=nodes,
        run_id=run_id,
        node_timeout_s=node_timeout_s,
    )
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
                log.warning(
                    "config.json declares %s=%d but the checkpoint holds no MTP tensors (saved "
                    "by transformers, which has no MTP module): converting without MTP",
                    field,
                    count,
                )
        if job.copies_absent and spec.index == 0:
            log.info(
                "the checkpoint stores no MTP copies of the embedding / LM head (%s): they equal the "
                "main ones, which megatron's MTP uses; the export leaves them out too",
                mapping._list(job.copies_absent, 5),
            )
        model = meta_model(job.family, job.hf_cfg, job.precision)
        completeness.check_produced(job.entries, model.state_dict(keep_vars=True))  # before any write
        written = streaming.save_streaming(
            model, job.entries, job.reader, job.ctx, tmp, spec, max_chunk_bytes, progress
        )
        if spec.index > 0:  # another node's part: node 0 publishes
            return dict(written_bytes=written, seconds=time.time() - started, node_rank=node_rank)
        mcore_io.copy_hf_side_files(hf_path, tmp / mcore_io.HF_SUBDIR, {field: 0 for field in job.mtp_dropped or {}})
        if job.carried:
            written += _carry(job, tmp)
        meta = dict(
            family=job.family.name,
            model_type=(job.whole.config if job.whole else job.hf_cfg).model_type,
            vocab_size=job.hf_cfg.vocab_size,
            padded_vocab_size=job.ctx["padded_vocab_size"],
            source=str(hf_path.resolve()),
            step=0,
            params_dtype=job.precision,
            hf_tensors=len(job.reader.names()),
        )
        if job.mtp_dropped:
            meta["mtp_dropped_from_config"] = job.mtp_dropped
        if job.copies_absent:  # export writes back exactly what the source stored
            meta[mcore_io.COPIES_ABSENT] = job.copies_absent
        if job.carried:
            meta["carried_tensors"] = {what: len(names) for what, names in job.carried.items()}
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
    log.info(
        "converted %d HF tensors into %d megatron tensors: %.2f GB in %.1fs (%.0f MB/s)",
        len(job.reader.names()),
        len(job.entries),
        written / 1e9,
        seconds,
        written / 1e6 / max(seconds, 1e-9),
    )
    meta["written_bytes"], meta["seconds"] = written, seconds
    return meta


def _carry(job, tmp: Path) -> int:
    """The source's tensors outside the language model, into `<tmp>/hf/carried/` (composite.py);
    the bytes written."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[job.precision]
    written = composite.write_carried(job.reader, composite.carried_names(job.carried), tmp / mcore_io.HF_SUBDIR, dtype)
    log.info(
        "%s carried through, not trained: written back unchanged by the export (%s)",
        composite.describe(job.carried),
        job.whole.spec.hf_model_class.__name__,
    )
    return written
