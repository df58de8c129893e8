"""torchrun -m moe_sft.train --config-path DIR --config-name NAME [key=value ...]

Exit codes: 0 done (or stopped by a signal / STOP file after a checkpoint, or nothing left to
train), 2 bad input (config, data, checkpoint, output dir in use), 3 non-finite training, 4 disk
full. Under torchrun a non-zero exit is followed by torchrun's own `ChildFailedError` report: the
`error:` line above it is ours, and the report repeats it (the worker's error file).
"""

from __future__ import annotations

import json
import os
import sys
import time

# MoE steps allocate tensors of a new size every micro-batch (routed rows per expert, packed
# lengths); torch's default caching allocator then holds much more than it hands out
# (docs/planner.md). Expandable segments map such requests onto growing segments instead. Read at
# the first CUDA allocation, so set before anything touches the GPU; a value the user set wins.
ALLOCATOR_DEFAULT = "expandable_segments:True"


def default_allocator_config() -> None:
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT


def fail(line: str, code: int) -> int:
    """One line on stderr, and the torchrun worker's error file, so that torchrun's report shows
    the line where it otherwise says "To enable traceback see ..."."""
    print(line, file=sys.stderr, flush=True)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            with open(error_file, "w") as f:
                json.dump(
                    {
                        "message": {
                            "message": line,
                            "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
                        }
                    },
                    f,
                )
        except OSError:
            pass
    return code


def main(argv: list[str], hooks=None) -> int:
    """`hooks`: a moe_sft.trainer.hooks.TrainHooks (tests inject faults through it)."""
    default_allocator_config()
    from moe_sft.config import ConfigError, load_config

    try:
        cfg = load_config(argv)
    except ConfigError as err:
        return fail(f"config error: {err}", 2)
    if cfg.trainer.dry_run:  # the plan and every rank's role: no process group, no GPU
        from moe_sft.plan import dry_run

        return dry_run(cfg)
    from moe_sft.errors import user_errors
    from moe_sft.trainer.guard import NonFiniteTrainingError
    from moe_sft.trainer.run_lock import RunLockError, disk_full_message
    from moe_sft.trainer.trainer import Trainer

    trainer = Trainer(cfg, hooks)
    try:
        trainer.setup()
        trainer.train()
    except ConfigError as err:
        return fail(f"config error: {err}", 2)
    except (RunLockError, *user_errors()) as err:  # bad data, checkpoint or model files, dir in use
        return fail(f"error: {err}", getattr(err, "exit_code", 2))  # the export's disk full: 4
    except NonFiniteTrainingError as err:  # the last good checkpoint is intact
        return fail(f"error: {err}", 3)
    except BaseException as err:  # torch's CheckpointException (a failed write) is a BaseException
        message = (
            None
            if isinstance(err, (KeyboardInterrupt, SystemExit))
            else disk_full_message(err, trainer.out, remove_partial=os.environ.get("RANK", "0") == "0")
        )
        if message is None:
            raise
        return fail(f"error: {message}", 4)
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns a process: the guard is required
    sys.exit(main(sys.argv[1:]))
