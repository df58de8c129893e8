"""A helper process of a multi-process conversion (`convert(..., workers=N)`, `--workers N`).

    python -m moe_sft.conversion.convert_worker --hf-path HF --staging OUT.tmp --worker I --workers N --digest D

Started by the coordinator (workers.start_local_helpers), never by hand: it plans the checkpoint the
same way (checked by digest), writes its share of the chunks as `__I_*.distcp` into the staging
directory and leaves its write results beside them for the coordinator's `.metadata`.
"""

import argparse
import sys
import time

from moe_sft.conversion.hf_source import prepare
from moe_sft.conversion.meta_model import meta_model
from moe_sft.conversion.streaming import save_streaming
from moe_sft.conversion.workers import WorkerSpec, report_failure


def worker_main(argv: list[str] | None = None) -> int:
    """A local helper of a multi-process conversion (started by its node's leading process)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-path", required=True)
    parser.add_argument("--staging", required=True)
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--run-id", default="local")
    parser.add_argument("--digest", required=True)
    parser.add_argument("--max-chunk-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    spec = WorkerSpec(args.workers, args.worker, args.hf_path, args.digest, args.nodes, args.run_id)
    started = time.time()
    try:
        job = prepare(args.hf_path)
        model = meta_model(job.family, job.hf_cfg, job.precision)
        written = save_streaming(model, job.entries, job.reader, job.ctx, args.staging, spec, args.max_chunk_bytes)
    except BaseException:
        report_failure(args.staging, spec)
        raise
    print(f"worker {args.worker}: wrote {written / 1e9:.2f} GB in {time.time() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
