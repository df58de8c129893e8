"""torchrun -m moe_sft.train --config-path DIR --config-name NAME [key=value ...]"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
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
