"""Read SFT rows from JSON Lines files into validated conversations.

One row per line: {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}.
Blank lines are skipped. Messages may carry extra keys (e.g. "reasoning_content", "tool_calls")
that a chat template uses; they are passed through untouched.

Every error names the file and the 1-based line number and says how to fix the row, because a
bad row in a million-row file is otherwise impossible to find.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
SUPPORTED_SUFFIXES = (".jsonl",)


class DataFormatError(ValueError):
    """A data file or row that cannot be used; the message says where and how to fix it."""


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    source: str  # "path:line", for error messages further down the pipeline


def iter_conversations(paths: Sequence[str | Path]) -> Iterator[Conversation]:
    """Yield validated conversations from `paths`, in order, one line at a time (constant memory)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]  # a single path is a common slip; treat it as a list of one
    if not paths:
        raise DataFormatError("no data files given; set the data paths to one or more .jsonl files")
    for path in map(Path, paths):
        yield from _iter_file(path)


def read_conversations(paths: Sequence[str | Path]) -> list[Conversation]:
    """All conversations of `paths` as a list (see `iter_conversations`)."""
    return list(iter_conversations(paths))


def _iter_file(path: Path) -> Iterator[Conversation]:
    if path.suffix not in SUPPORTED_SUFFIXES:
        raise DataFormatError(
            f"{path}: unsupported file type {path.suffix!r}; supported: {', '.join(SUPPORTED_SUFFIXES)} "
            '(one JSON object per line: {"messages": [...]})'
        )
    if not path.is_file():
        raise DataFormatError(f"{path}: no such file; check the data path (relative paths start at the cwd)")
    n_rows = 0
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            yield Conversation(messages=parse_row(line, where), source=where)
            n_rows += 1
    if n_rows == 0:
        raise DataFormatError(f"{path}: the file has no rows; remove it from the data paths or add rows")


def parse_row(line: str, where: str) -> list[dict]:
    """Parse one JSON line and return its validated messages; `where` is "path:line"."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataFormatError(
            f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line must be one complete JSON object"
        ) from None
    if not isinstance(row, dict) or "messages" not in row:
        got = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataFormatError(
            f'{where}: row has no "messages" field (got {got}); '
            'write rows as {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
        )
    return validate_messages(row["messages"], where)


def validate_messages(messages: object, where: str) -> list[dict]:
    """Check the message list of one row; return it unchanged if it is usable."""
    if not isinstance(messages, list) or not messages:
        raise DataFormatError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    for i, message in enumerate(messages):
        _validate_message(message, f"{where}: messages[{i}]")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataFormatError(
            f"{where}: conversation has no assistant message, so nothing would be trained on; "
            'add an {"role": "assistant", "content": ...} turn or remove the row'
        )
    return messages


def _validate_message(message: object, where: str) -> None:
    if not isinstance(message, dict):
        raise DataFormatError(f'{where}: must be an object like {{"role": "user", "content": "..."}}, got {message!r}')
    missing = [key for key in ("role", "content") if key not in message]
    if missing:
        raise DataFormatError(f"{where}: missing {' and '.join(missing)}; every message needs a role and a content")
    role, content = message["role"], message["content"]
    if role not in ALLOWED_ROLES:
        raise DataFormatError(f"{where}: unknown role {role!r}; allowed roles: {', '.join(ALLOWED_ROLES)}")
    if not isinstance(content, str):
        raise DataFormatError(
            f"{where}: content must be a string, got {type(content).__name__}; "
            "join multi-part content into one string before training"
        )

