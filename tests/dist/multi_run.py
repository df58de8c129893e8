"""Several `moe_sft.train` runs of one world size in one torchrun launch (tests/dist/launch.py
`torchrun_cases`): the launch pays process start-up, the imports and the process group once.

    torchrun ... tests/dist/multi_run.py CASES.json

CASES.json is a list of `moe_sft.train` command lines, run in order. Before each, rank 0 prints
CASE_MARK and the case's index, so the launch's stdout splits into one log per run. Between runs
only megatron's model-parallel groups are destroyed (the next run's layout makes new ones); the
world group stays for the next run, and goes after the last. The first run that fails ends the
launch with its exit code.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CASE_MARK = "@@ multi_run case "


def _keep_world_group() -> None:
    """`moe_sft.runtime.distributed.destroy` (Trainer.close) without destroying the world group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)


def main(cases: list[list[str]]) -> int:
    import torch.distributed as dist

    from moe_sft.runtime import distributed
    from moe_sft.train import main as train_main

    destroy, distributed.destroy = distributed.destroy, _keep_world_group
    try:
        for index, argv in enumerate(cases):
            if os.environ.get("RANK", "0") == "0":
                print(f"{CASE_MARK}{index}", flush=True)
            rc = train_main(argv)
            sys.stdout.flush()
            if rc != 0:
                return rc
            if dist.is_initialized():
                dist.barrier()  # every rank has closed the run (its lock, its checkpoint writers)
    finally:
        distributed.destroy = destroy
        destroy()
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns a process: the guard is required
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's moe_sft, as `-m` from its root
    sys.exit(main(json.loads(Path(sys.argv[1]).read_text())))
