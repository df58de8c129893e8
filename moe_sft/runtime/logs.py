"""The one logger of moe-sft: python `logging` under the name `moe_sft`, rank-aware.

Every module logs through `get_logger(__name__)`. One handler writes to the process's current
stdout (looked up per record, so pytest's capture and redirected streams see it):

    [moe-sft] message                    rank 0 (or a process outside torch.distributed)
    [moe-sft rank 3] message             any rank, for records logged with `extra=ALL_RANKS`

Records of other ranks are dropped: N ranks that compute the same line print it once.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "moe_sft"
ALL_RANKS = {"all_ranks": True}  # extra= for a record every rank prints (per-rank facts)


def process_rank() -> int:
    """This process's global rank: torch.distributed's, else torchrun's RANK, else 0."""
    dist = sys.modules.get("torch.distributed")  # not imported here: the planner runs without torch
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _CurrentStdout(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rank = getattr(record, "rank", 0)
        prefix = f"[moe-sft rank {rank}]" if getattr(record, "all_ranks", False) else "[moe-sft]"
        level = (
            ""
            if record.levelno < logging.WARNING or record.getMessage().startswith("WARNING")
            else (f"{record.levelname}: ")
        )
        text = f"{prefix} {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def _rank_filter(record: logging.LogRecord) -> bool:
    record.rank = process_rank()
    return record.rank == 0 or getattr(record, "all_ranks", False)


def _configure() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _CurrentStdout) for h in root.handlers):
        handler = _CurrentStdout(sys.stdout)
        handler.setFormatter(_RankFormatter())
        handler.addFilter(_rank_filter)
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # one line per record, whatever the application's root logger does
    return root


def get_logger(name: str = ROOT) -> logging.Logger:
    """The logger for `name` (a module's __name__ under moe_sft, or a tool's), configured once."""
    _configure()
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")
