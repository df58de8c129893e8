"""Conversation → token ids + assistant mask, through the tokenizer's own chat template.

The mask is True on the tokens the model must learn to produce: each assistant message's content
and the end-of-turn token that closes it (`<|im_end|>` in ChatML), nothing else: not the role
header, not system/user/tool text, not the newline after the end token.

Two ways to find those tokens:

* Generation markers. Templates that wrap assistant output in `{% generation %}...{% endgeneration %}`
  let transformers compute the mask (`apply_chat_template(..., return_assistant_tokens_mask=True)`).
* Prefix diff, for templates without markers (Qwen3's, Llama 3's). The text rendered for
  `messages[:i]` with `add_generation_prompt=True` ends exactly where assistant message `i` starts;
  the message ends at the first end-of-turn string after that point. This survives templates that
  restyle the *last* turns (Qwen3 adds an empty `<think></think>` block to turns after the last user
  query): that block comes after the generation prompt, so it is trained on, as the model must
  emit it at inference too.

Both produce character spans in the rendered text; the tokens overlapping a span are masked.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from jinja2 import TemplateError

from moe_sft.data.formats import DataFormatError, iter_conversations

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_FALLBACK_END_OF_TURN = "<|im_end|>"

Overlong = Literal["truncate", "drop"]


@dataclass(frozen=True)
class TokenizedDoc:
    """One tokenized conversation: ids and, per id, whether the model is trained to produce it."""

    input_ids: list[int]
    assistant_mask: list[bool]
    source: str = ""  # "path:line" of the row, for error messages
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Positions with a loss once labels are shifted: token i is predicted from i-1, so token 0 never is."""
        return sum(self.assistant_mask[1:])


@dataclass
class TokenizeStats:
    n_rows: int = 0  # rows read
    n_truncated: int = 0  # rows kept but cut to max_seq_len
    n_dropped: int = 0  # rows not kept (overlong with overlong="drop", or no assistant token left after truncation)
    n_tokens: int = 0  # tokens in kept documents
    n_loss_tokens: int = 0  # loss positions in kept documents (TokenizedDoc.num_loss_tokens)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def has_generation_markers(chat_template: str | None) -> bool:
    return bool(chat_template) and _GENERATION_TAG.search(chat_template) is not None


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    max_seq_len: int,
    overlong: Overlong = "truncate",
    *,
    source: str = "",
    end_of_turn: str | None = None,
) -> TokenizedDoc | None:
    """Tokenize one conversation; None when it is dropped.

    overlong="truncate" keeps the first `max_seq_len` tokens; a conversation whose truncated part
    has no loss position left is dropped, as it would only cost compute. overlong="drop" drops
    every conversation longer than `max_seq_len`. `end_of_turn` (prefix-diff path only) overrides
    the string that closes an assistant turn; by default the first eos token or `<|im_end|>`.
    """
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong={overlong!r} is not supported; use 'truncate' or 'drop'")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len={max_seq_len} leaves nothing to learn; use at least 2 (typically 2048 or more)")
    if not tokenizer.chat_template:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat_template; use an instruct model's "
            "tokenizer (data.tokenizer_path) or set tokenizer.chat_template"
        )
    try:
        if has_generation_markers(tokenizer.chat_template):
            input_ids, mask = assistant_mask_from_markers(tokenizer, messages)
        else:
            input_ids, mask = assistant_mask_from_prefixes(tokenizer, messages, source=source, end_of_turn=end_of_turn)
    except TemplateError as e:  # e.g. the template's raise_exception("roles must alternate ...")
        raise DataFormatError(f"{source or 'conversation'}: the chat template rejected this row: {e}") from e
    if not any(mask):
        raise DataFormatError(
            f"{source or 'conversation'}: the chat template marked no assistant token; check that it renders "
            "assistant messages (and, if it uses {% generation %}, that the block wraps their content)"
        )
    doc = TokenizedDoc(input_ids, mask, source)
    if len(input_ids) <= max_seq_len:
        return doc
    if overlong == "drop":
        return None
    doc = TokenizedDoc(input_ids[:max_seq_len], mask[:max_seq_len], source, truncated=True)
    return doc if doc.num_loss_tokens > 0 else None


def assistant_mask_from_markers(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Ids and mask from a template with `{% generation %}` markers (transformers computes the mask)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def assistant_mask_from_prefixes(
    tokenizer, messages: list[dict], *, source: str = "", end_of_turn: str | None = None
) -> tuple[list[int], list[bool]]:
    """Ids and mask for templates without generation markers, by rendering prefixes (see module doc)."""
    where = source or "conversation"
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    defaults = (tokenizer.eos_token, _FALLBACK_END_OF_TURN)
    ends = [end_of_turn] if end_of_turn else list(dict.fromkeys(t for t in defaults if t))
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise DataFormatError(
                f"{where}: messages[0] is an assistant message; without {{% generation %}} markers in the chat "
                "template its start cannot be found. Add a system or user message before it, or add the markers"
            )
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        if not text.startswith(prefix):
            raise DataFormatError(
                f"{where}: the chat template renders messages[:{i}] + generation prompt differently from the start "
                "of the full conversation, so assistant tokens cannot be located; use a template with "
                "{% generation %}...{% endgeneration %} around assistant content"
            )
        spans.append((len(prefix), _turn_end(text, len(prefix), ends, f"{where}: messages[{i}]")))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoding["input_ids"]), _mask_from_spans(encoding["offset_mapping"], spans)


def _turn_end(text: str, start: int, ends: list[str], where: str) -> int:
    """Index just past the end-of-turn string closing the assistant turn that starts at `start`.

    Candidates are the eos token and ChatML's `<|im_end|>`, and the *earliest* one found wins: a
    base-model tokenizer (Qwen3 base: eos `<|endoftext|>`) ships a ChatML template whose turns end
    with `<|im_end|>`, while the eos may appear only later, or not at all.
    """
    found = [(text.find(end, start), end) for end in ends]
    found = [(pos, end) for pos, end in found if pos >= 0]
    if not found:
        raise DataFormatError(
            f"{where}: the assistant turn is not closed by any of {ends}; pass end_of_turn='<your end token>'"
        )
    pos, end = min(found)
    return pos + len(end)


def _mask_from_spans(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """True for each token whose character range overlaps one of the sorted, disjoint `spans`."""
    mask, k = [], 0
    for start, stop in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        mask.append(k < len(spans) and start < spans[k][1] and stop > spans[k][0])
    return mask


def tokenize_files(
    tokenizer,
    paths: Sequence[str | Path],
    max_seq_len: int,
    overlong: Overlong = "truncate",
    *,
    end_of_turn: str | None = None,
) -> tuple[list[TokenizedDoc], TokenizeStats]:
    """Read, validate and tokenize every row of `paths`; returns the kept documents and counts."""
    docs, stats = [], TokenizeStats()
    for conversation in iter_conversations(paths):
        stats.n_rows += 1
        doc = tokenize_conversation(
            tokenizer, conversation.messages, max_seq_len, overlong, source=conversation.source, end_of_turn=end_of_turn
        )
        if doc is None:
            stats.n_dropped += 1
            continue
        stats.n_truncated += doc.truncated
        stats.n_tokens += len(doc)
        stats.n_loss_tokens += doc.num_loss_tokens
        docs.append(doc)
    return docs, stats
