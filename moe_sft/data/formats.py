"""Read SFT rows from files and turn each into a validated conversation.

Files (one kind per path, picked by suffix):

* `.jsonl`: one JSON object per line, read as bytes one line at a time (constant memory);
* `.json`: a JSON array of objects (loaded whole; use .jsonl or parquet for big data), or JSON
  Lines under a .json name (detected: the file does not start with `[`);
* `.parquet`: read one record batch at a time with pyarrow;
* a directory written by HF `datasets` `save_to_disk` (one split; memory-mapped arrow).

Row formats (`data.format: auto` picks one per row from its keys; `data.fields` renames keys):

* messages (OpenAI): {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...,
  "tool_calls": [...], "reasoning_content": ..., "weight": 0.5}], "tools": [...]}
* sharegpt: {"conversations": [{"from": "human"|"gpt"|"system"|"observation"|..., "value": ...}],
  "system": ...}
* alpaca: {"instruction": ..., "input": ..., "output": ..., "system": ...}
* prompt_completion: {"prompt": str | [messages], "completion": str | [messages]}

Every problem with a row is a `RowError` with a category (`ROW_ERRORS`) and a message that
starts with "path:line" (for parquet and HF datasets: the 1-based row number), so a bad row in
a million-row file can be found; the caller decides to skip and report it or to stop.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")
FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion")
# Canonical field names; `data.fields` maps any of them to the name used in the files.
CANONICAL_FIELDS = (
    "messages",
    "role",
    "content",
    "conversations",
    "from",
    "value",
    "instruction",
    "input",
    "output",
    "system",
    "prompt",
    "completion",
    "tools",
    "weight",
)
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
    "function_response": "tool",
    "ipython": "tool",
}

# Row error categories, in report order. Overlong rows are not errors (data.overlong decides).
INVALID_JSON, NON_UTF8, WRONG_SHAPE, UNKNOWN_ROLE = "invalid_json", "non_utf8", "wrong_shape", "unknown_role"
EMPTY_ASSISTANT, NO_ASSISTANT, TEMPLATE_ERROR = "empty_assistant", "no_assistant", "template_error"
NO_TRAINABLE_TOKENS = "no_trainable_tokens"
ROW_ERRORS = (
    INVALID_JSON,
    NON_UTF8,
    WRONG_SHAPE,
    UNKNOWN_ROLE,
    EMPTY_ASSISTANT,
    NO_ASSISTANT,
    TEMPLATE_ERROR,
    NO_TRAINABLE_TOKENS,
)


class DataFormatError(ValueError):
    """A data file or row that cannot be used; the message says where and how to fix it."""


class RowError(DataFormatError):
    """One unusable row: `category` is one of ROW_ERRORS; the message starts with "path:line"."""

    def __init__(self, category: str, message: str):
        super().__init__(message)
        self.category = category


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    source: str  # "path:line", for error messages further down the pipeline
    tools: list | None = None  # function schemas the chat template renders (messages format "tools")


@dataclass(frozen=True)
class RowFormat:
    """How rows are read: the format (or auto) and renamed fields (canonical name → file's name)."""

    format: str = "auto"
    fields: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @classmethod
    def make(cls, format: str = "auto", fields: Mapping[str, str] | None = None) -> RowFormat:
        if format not in FORMATS:
            raise ValueError(f"data.format={format!r} is not one of {' | '.join(FORMATS)}")
        unknown = sorted(set(fields or {}) - set(CANONICAL_FIELDS))
        if unknown:
            raise ValueError(f"data.fields has unknown keys {unknown}; known: {', '.join(CANONICAL_FIELDS)}")
        return cls(format, tuple(sorted((fields or {}).items())))

    def name(self, canonical: str) -> str:
        return dict(self.fields).get(canonical, canonical)


# ----------------------------------------------------------------------------- files → records


def file_kind(path: str | Path) -> str:
    """'jsonl' | 'json' | 'parquet' | 'hf' for a data path; DataFormatError if unsupported or missing."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            raise DataFormatError(
                f"{path}: an HF DatasetDict with splits {splits}; name one split's directory, "
                f"e.g. {path / (splits[0] if splits else 'train')}"
            )
        if not (path / "state.json").is_file():
            raise DataFormatError(
                f"{path}: a directory but not an HF dataset saved with save_to_disk "
                "(no state.json); give .jsonl/.json/.parquet files or a save_to_disk directory"
            )
        return "hf"
    if path.suffix not in SUPPORTED_SUFFIXES:
        raise DataFormatError(
            f"{path}: unsupported file type {path.suffix!r}; supported: {', '.join(SUPPORTED_SUFFIXES)} "
            "or a directory written by datasets' save_to_disk"
        )
    if not path.is_file():
        raise DataFormatError(f"{path}: no such file; check the data path (relative paths start at the cwd)")
    return path.suffix[1:]


def iter_records(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line, payload) per row, in file order; payload is bytes (a JSON line), a dict-like row, or a
    RowError for a row that could not even be read. Line numbers are 1-based."""
    kind = file_kind(path)
    reader = {"jsonl": _jsonl_records, "json": _json_records, "parquet": _parquet_records, "hf": _hf_records}[kind]
    n_rows = 0
    for record in reader(Path(path)):
        n_rows += 1
        yield record
    if n_rows == 0:
        raise DataFormatError(f"{path}: the file has no rows; remove it from the data paths or add rows")


def _jsonl_records(path: Path) -> Iterator[tuple[int, object]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                yield lineno, raw


def _json_records(path: Path) -> Iterator[tuple[int, object]]:
    """A JSON array, element by element with its line; JSON Lines if the file is not an array."""
    with path.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head.startswith(b"["):
        yield from _jsonl_records(path)
        return
    # surrogateescape keeps bad bytes as lone surrogates: the element holding one is reported as
    # non-UTF-8, its neighbours stay usable.
    text = path.read_bytes().decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
    decoder, pos, line, counted = json.JSONDecoder(), text.index("[") + 1, 1, 0
    while True:
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == "]":
            return
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            yield (
                line,
                RowError(
                    INVALID_JSON,
                    f"{path}:{e.lineno}: invalid JSON in the array ({e.msg} at column "
                    f"{e.colno}); the rest of this file cannot be read",
                ),
            )
            return
        if _has_surrogates(text, pos, end):
            yield (
                line,
                RowError(
                    NON_UTF8,
                    f"{path}:{line}: the element holds bytes that are not valid UTF-8; re-encode the file as UTF-8",
                ),
            )
        else:
            yield line, value
        pos = _skip_space(text, end)
        if pos < len(text) and text[pos] == ",":
            pos += 1
        elif pos >= len(text) or text[pos] != "]":
            yield (
                line,
                RowError(
                    INVALID_JSON,
                    f"{path}:{line + text.count(chr(10), counted, pos)}: expected ',' or "
                    "']' after an array element; the rest of this file cannot be read",
                ),
            )
            return


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


_SURROGATE = re.compile("[\udc80-\udcff]")  # how surrogateescape spells an undecodable byte


def _has_surrogates(text: str, start: int, end: int) -> bool:
    return _SURROGATE.search(text, start, end) is not None


def _parquet_records(path: Path) -> Iterator[tuple[int, object]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            yield row, record


def _hf_records(path: Path) -> Iterator[tuple[int, object]]:
    from datasets import load_from_disk

    dataset = load_from_disk(str(path))  # memory-mapped arrow, not loaded into RAM
    row = 0
    for batch in dataset.iter(batch_size=1024):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys)):
            row += 1
            yield row, dict(zip(keys, values))


def decode_payload(payload: object, where: str) -> object:
    """The row object of a record: bytes are decoded (UTF-8) and parsed (JSON); its strings must be text."""
    if isinstance(payload, RowError):
        raise payload
    if not isinstance(payload, (bytes, bytearray)):
        check_text(payload, where)
        return payload
    row = _parse(payload, where)
    if b"\\ud" in payload or b"\\uD" in payload:  # only a \uD800-\uDFFF escape can leave a lone surrogate
        check_text(row, where)
    return row


def check_text(value: object, where: str, path: str = "the row") -> None:
    """RowError (non_utf8) naming the field of `value` whose string holds a lone UTF-16 surrogate.

    JSON allows `"\\ud800"` (half of a surrogate pair) and Python decodes it to a string that is no
    Unicode text: no tokenizer can encode it, and it would stop the build whatever data.on_error says."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RowError(
                NON_UTF8,
                f"{where}: {path} holds a lone surrogate U+{ord(value[e.start]):04X} at character {e.start} "
                "(a JSON escape like \\ud800 without its pair), which is not text; fix or remove it",
            ) from None
    elif isinstance(value, Mapping):
        for key, item in value.items():
            check_text(item, where, f"{path}.{key}" if path != "the row" else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_text(item, where, f"{path}[{i}]")


def _parse(payload: bytes | bytearray, where: str) -> object:
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowError(
            NON_UTF8,
            f"{where}: byte {e.start} ({payload[e.start : e.start + 1]!r}) is not valid UTF-8; "
            "re-encode the file as UTF-8",
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RowError(
            INVALID_JSON,
            f"{where}: invalid JSON ({e.msg} at column {e.colno}); each line must be one complete JSON object",
        ) from None


# ----------------------------------------------------------------------------- rows → messages


def to_conversation(row: object, fmt: RowFormat, where: str) -> Conversation:
    """A validated Conversation from one row object (any supported format)."""
    if not isinstance(row, Mapping):
        raise RowError(WRONG_SHAPE, f"{where}: a row must be a JSON object, got {type(row).__name__}")
    kind = fmt.format if fmt.format != "auto" else _detect(row, fmt, where)
    messages = {
        "messages": _from_messages,
        "sharegpt": _from_sharegpt,
        "alpaca": _from_alpaca,
        "prompt_completion": _from_prompt_completion,
    }[kind](row, fmt, where)
    validate_messages(messages, where)
    return Conversation(messages, where, _tools(row, fmt, where))


def _detect(row: Mapping, fmt: RowFormat, where: str) -> str:
    n = fmt.name
    if n("messages") in row:
        return "messages"
    if n("conversations") in row:
        return "sharegpt"
    if n("instruction") in row and n("output") in row:
        return "alpaca"
    if n("prompt") in row and n("completion") in row:
        return "prompt_completion"
    raise RowError(
        WRONG_SHAPE,
        f"{where}: row matches no known format (keys {sorted(row)}); expected "
        f'"{n("messages")}" (OpenAI messages), "{n("conversations")}" (ShareGPT), '
        f'"{n("instruction")}"+"{n("output")}" (alpaca) or "{n("prompt")}"+'
        f'"{n("completion")}"; set data.format / data.fields for other names',
    )


def _from_messages(row: Mapping, fmt: RowFormat, where: str) -> list[dict]:
    messages = row.get(fmt.name("messages"))
    if not isinstance(messages, list) or not messages:
        raise RowError(
            WRONG_SHAPE, f'{where}: "{fmt.name("messages")}" must be a non-empty list of {{"role", "content"}} objects'
        )
    return [_message(m, fmt, f"{where}: {fmt.name('messages')}[{i}]") for i, m in enumerate(messages)]


def _message(message: object, fmt: RowFormat, where: str) -> dict:
    role_key, content_key = fmt.name("role"), fmt.name("content")
    if not isinstance(message, Mapping):
        raise RowError(
            WRONG_SHAPE, f'{where}: must be an object like {{"role": "user", "content": "..."}}, got {message!r:.80}'
        )
    if role_key not in message:
        raise RowError(WRONG_SHAPE, f"{where}: missing {role_key}; every message needs a role")
    role = message[role_key]
    if role not in ALLOWED_ROLES:
        raise RowError(UNKNOWN_ROLE, f"{where}: unknown role {role!r}; allowed roles: {', '.join(ALLOWED_ROLES)}")
    has_calls = bool(message.get("tool_calls"))
    if content_key not in message and not (role == "assistant" and has_calls):
        raise RowError(
            WRONG_SHAPE,
            f"{where}: missing {content_key}; every message needs a content "
            "(an assistant message with tool_calls may have none)",
        )
    if role == "assistant" and message.get("tool_responses"):
        # Gemma's native layout: the template writes these results inside the model turn, between the
        # calls and the content, so what the tools wrote could not be told from what the model wrote.
        raise RowError(
            WRONG_SHAPE,
            f"{where}: an assistant message with tool_responses (the tools' results inside the model's "
            "message); give each result as a tool message after it, and the answer as the next assistant message",
        )
    out = {k: v for k, v in message.items() if k not in (role_key, content_key) and v is not None}
    out["role"], out["content"] = role, _text(message.get(content_key), where)
    if fmt.name("weight") != "weight" and fmt.name("weight") in out:
        out["weight"] = out.pop(fmt.name("weight"))
    return out


def _text(content: object, where: str) -> str:
    """Message content as one string: a string, null (tool-call turns), or OpenAI text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise RowError(
        WRONG_SHAPE,
        f"{where}: content must be a string or a list of "
        f'{{"type": "text", "text": ...}} parts, got {type(content).__name__}',
    )


def _from_sharegpt(row: Mapping, fmt: RowFormat, where: str) -> list[dict]:
    turns, src, val = row.get(fmt.name("conversations")), fmt.name("from"), fmt.name("value")
    if not isinstance(turns, list) or not turns:
        raise RowError(
            WRONG_SHAPE,
            f'{where}: "{fmt.name("conversations")}" must be a non-empty list of {{"{src}", "{val}"}} objects',
        )
    messages = _system(row, fmt, where)
    for i, turn in enumerate(turns):
        here = f"{where}: {fmt.name('conversations')}[{i}]"
        if not isinstance(turn, Mapping) or src not in turn or val not in turn:
            raise RowError(WRONG_SHAPE, f'{here}: must be an object with "{src}" and "{val}", got {turn!r:.80}')
        role = SHAREGPT_ROLES.get(turn[src])
        if role is None:
            raise RowError(
                UNKNOWN_ROLE, f"{here}: unknown role {turn[src]!r}; ShareGPT roles: {', '.join(SHAREGPT_ROLES)}"
            )
        message = {"role": role, "content": _text(turn[val], here)}
        if "weight" in turn or fmt.name("weight") in turn:
            message["weight"] = turn.get(fmt.name("weight"), turn.get("weight"))
        messages.append(message)
    return messages


def _from_alpaca(row: Mapping, fmt: RowFormat, where: str) -> list[dict]:
    parts = {k: row.get(fmt.name(k)) for k in ("instruction", "input", "output")}
    for key, value in parts.items():
        if not isinstance(value, str) and not (key == "input" and value is None):
            raise RowError(
                WRONG_SHAPE, f'{where}: alpaca "{fmt.name(key)}" must be a string, got {type(value).__name__}'
            )
    prompt = parts["instruction"] + (f"\n\n{parts['input']}" if parts["input"] else "")
    return _system(row, fmt, where) + [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": parts["output"]},
    ]


def _from_prompt_completion(row: Mapping, fmt: RowFormat, where: str) -> list[dict]:
    out = _system(row, fmt, where)
    for key, role in (("prompt", "user"), ("completion", "assistant")):
        value = row.get(fmt.name(key))
        if isinstance(value, str):
            out.append({"role": role, "content": value})
        elif isinstance(value, list) and value:
            out += [_message(m, fmt, f"{where}: {fmt.name(key)}[{i}]") for i, m in enumerate(value)]
        else:
            raise RowError(
                WRONG_SHAPE,
                f'{where}: "{fmt.name(key)}" must be a string or a non-empty list of '
                f"messages, got {type(value).__name__}",
            )
    return out


def _system(row: Mapping, fmt: RowFormat, where: str) -> list[dict]:
    system = row.get(fmt.name("system"))
    if system in (None, ""):
        return []
    if not isinstance(system, str):
        raise RowError(WRONG_SHAPE, f'{where}: "{fmt.name("system")}" must be a string')
    return [{"role": "system", "content": system}]


def _tools(row: Mapping, fmt: RowFormat, where: str) -> list | None:
    tools = row.get(fmt.name("tools"))
    if isinstance(tools, str) and tools.strip():  # some datasets store the schema list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise RowError(WRONG_SHAPE, f'{where}: "{fmt.name("tools")}" is a string but not JSON') from None
    if tools in (None, "", []):
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise RowError(WRONG_SHAPE, f'{where}: "{fmt.name("tools")}" must be a list of function schemas')
    return tools


def validate_messages(messages: Sequence[dict], where: str) -> None:
    """Conversation-level checks: there is an assistant turn, none is empty, weights are numbers."""
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(
            NO_ASSISTANT,
            f"{where}: conversation has no assistant message, so nothing would be trained "
            'on; add an {"role": "assistant", "content": ...} turn or remove the row',
        )
    for i, m in enumerate(messages):
        if "weight" in m:
            w = m["weight"]
            if m["role"] != "assistant":
                raise RowError(
                    WRONG_SHAPE,
                    f"{where}: messages[{i}] ({m['role']}) has a weight; weights apply to assistant messages only",
                )
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < float("inf"):
                raise RowError(WRONG_SHAPE, f"{where}: messages[{i}] weight={w!r} must be a number >= 0")
        if (
            m["role"] == "assistant"
            and not m["content"].strip()
            and not m.get("tool_calls")
            and not m.get("reasoning_content")
            and not m.get("thinking")  # gpt-oss's reasoning field
        ):
            raise RowError(
                EMPTY_ASSISTANT,
                f"{where}: messages[{i}] is an assistant message with empty content "
                "(and no tool_calls); fill it in or remove the row",
            )


# ----------------------------------------------------------------------------- convenience (fail-fast)


def iter_conversations(paths: Sequence[str | Path], fmt: RowFormat | None = None) -> Iterator[Conversation]:
    """Validated conversations of `paths`, in order; the first bad row raises its RowError."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]  # a single path is a common slip; treat it as a list of one
    if not paths:
        raise DataFormatError("no data files given; set the data paths to one or more data files")
    fmt = fmt or RowFormat()
    for path in paths:
        for line, payload in iter_records(path):
            where = f"{path}:{line}"
            yield to_conversation(decode_payload(payload, where), fmt, where)


def read_conversations(paths: Sequence[str | Path], fmt: RowFormat | None = None) -> list[Conversation]:
    """All conversations of `paths` as a list (see `iter_conversations`)."""
    return list(iter_conversations(paths, fmt))
