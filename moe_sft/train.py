"""torchrun -m moe_sft.train --config-path DIR --config-name NAME [key=value ...]"""

from __future__ import annotations

import os
import sys

# MoE steps allocate tensors of a new size every micro-batch (routed rows per expert, packed
# lengths); torch's default caching allocator then holds 17-31% more than it hands out (measured:
# docs/planner.md). Expandable segments map such requests onto growing segments instead. Read at
# the first CUDA allocation, so set before anything touches the GPU; a value the user set wins.
ALLOCATOR_DEFAULT = "expandable_segments:True"


def default_allocator_config() -> None:
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT


def main(argv: list[str]) -> int:
    default_allocator_config()
    from moe_sft.config import ConfigError, load_config

    try:
        cfg = load_config(argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if cfg.trainer.dry_run:  # the plan and every rank's role: no process group, no GPU
        from moe_sft.plan import dry_run

        return dry_run(cfg)
    from moe_sft.errors import user_errors
    from moe_sft.trainer.guard import NonFiniteTrainingError
    from moe_sft.trainer.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.setup()
        trainer.train()
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except user_errors() as err:  # bad data, checkpoint or model files: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteTrainingError as err:  # the last good checkpoint is intact
        print(f"error: {err}", file=sys.stderr)
        return 3
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns a process: the guard is required
    sys.exit(main(sys.argv[1:]))
