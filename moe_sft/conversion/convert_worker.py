"""A helper process of a multi-process conversion (`convert(..., workers=N)`, `--workers N`).

    python -m moe_sft.conversion.convert_worker --hf-path HF --staging OUT.tmp --worker I --workers N --digest D

Started by the coordinator (workers.start_local_helpers), never by hand: it plans the checkpoint the
same way (checked by digest), writes its share of the chunks as `__I_*.distcp` into the staging
directory and leaves its write results beside them for the coordinator's `.metadata`.
"""

import sys

from moe_sft.conversion.workers import worker_main

if __name__ == "__main__":
    sys.exit(worker_main())
