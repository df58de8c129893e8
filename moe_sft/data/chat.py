"""Conversation → token ids + a loss weight per token, through the chat template.

The weight is > 0 on the tokens the model must learn to produce: each trained assistant turn
from the end of its header (what `add_generation_prompt` emits) through the end-of-turn token
that closes it (`<|im_end|>`, `<|eot_id|>`, ...), nothing else: not the role header, not
system/user/tool text, not the newline after the end token. Which assistant turns are trained:
`loss_on="all_assistant"` (default) or `"last_assistant"`; a message's own `"weight"` (a number
>= 0) overrides that default for the message.

Everything is computed on the text the template renders for the *whole* conversation, and
tokens are mapped to it by character offsets. Templates may render history differently from
how the turn was generated (Qwen3 and DeepSeek-R1 drop the reasoning of earlier turns), so
per-turn rendering + concatenation would train on text the model never sees; we never do that.
Assistant spans in the rendered text are found one of two ways:

* Generation markers. A template that wraps assistant output in `{% generation %}` blocks gives
  the spans directly (transformers' `render_jinja_template(..., return_assistant_tokens_mask=True)`).
* Prefix diff, for templates without markers. The text rendered for `messages[:i]` with the
  generation prompt ends exactly where assistant message `i` starts when it is a prefix of the
  full text. When it is not (the template re-rendered earlier turns, e.g. stripped their
  reasoning), the full conversation is rendered again with message `i`'s content replaced by a
  sentinel (and with its first tool call's arguments replaced: Gemma 4 writes the calls' results
  before the content); the texts agree up to where message `i`'s own text starts, and its header is the
  last occurrence of the generation prompt before that point, extended back over the segments of
  the same turn right before it (harmony: an answer's reasoning segment,
  `turn_ends.continued_turn_start`). Templates whose prompt also opens a `<think>` block the turn
  shows otherwise or not at all (DeepSeek-R1, MiniMax-M2, Nemotron-3's `<think></think>`): the
  longest prefix of the prompt found there, followed by the turn's text or an added token. The
  turn ends at the first end-of-turn string after its start. Template-inserted text after the
  header (Qwen3's empty `<think></think>` on the last turn) is trained on, as the model must emit
  it at inference, unless `empty_think="mask"` (data.empty_think) takes empty reasoning blocks out.
* Suffix alignment, when there is no header to search for (Mistral's templates have no generation
  prompt and move the system prompt and tools list to the last user message) or the turn's
  content is not rendered (a tool-call-only turn): the render of `messages[:i]` still ends with
  the previous message as the full text shows it, and the turn starts where the longest common
  suffix of the two ends.

A turn ends with the first end-of-turn string after its start (the eos token, `<|im_end|>`,
`<|eot_id|>`, harmony's `<|end|>` / `<|call|>`, Gemma's `<end_of_turn>` / `<turn|>` / `<|tool_response>`,
or `data.end_of_turn`: `turn_ends.KNOWN_END_OF_TURN`), which is trained, unless the
generation prompt's header follows it directly and the next message is not an assistant message:
then the turn goes on to the next end string (harmony, gpt-oss, writes one assistant message as
reasoning and answer segments, `turn_ends.continued_turn_end`). Templates that close no turn with one
(GLM-4.5/4.6/4.7: `...answer<|user|>`, `...</tool_call><|observation|>`) end a turn where the next
message's role tag begins: the render of `messages[:i + 1]` ends with the turn as the full text
shows it, so the turn ends where their longest common suffix ends, and the role tag that follows
is trained when it hands over to the user or a tool (`moe_sft.data.turn_ends.end_at_role_tag`).
The last turn ends with the text, which has nothing after it: when that turn is trained, the tag
the template writes after it once a user message (after a tool call: a tool result) follows (GLM:
`<|user|>`, `<|observation|>`, its stop tokens) is appended to the ids with the turn's weight
(`ChatOptions.close_last_turn`, default on; off keeps the ids exactly `apply_chat_template`'s).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from jinja2 import TemplateError

from moe_sft.data.formats import (
    NO_TRAINABLE_TOKENS,
    TEMPLATE_ERROR,
    DataFormatError,
    RowError,
    RowFormat,
    decode_payload,
    iter_records,
    to_conversation,
)
from moe_sft.data.stats import DataStats
from moe_sft.data.turn_ends import (
    KNOWN_END_OF_TURN,
    added_token_at,
    common_suffix,
    content_after_turn,
    continued_turn_end,
    continued_turn_start,
    end_at_role_tag,
    handover_tag,
    turn_end,
    writes_end_of_turn,
)

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SENTINEL = "\u2063moe-sft-sentinel\u2063"  # content no real row has (U+2063: invisible separator)
LOSS_ON = ("all_assistant", "last_assistant")
EMPTY_THINK = ("train", "mask")
# An empty reasoning block and the whitespace after it, as templates write it into turns without
# reasoning: Qwen3 `<think>\n\n</think>\n\n`, GLM-4.5 `<think></think>\n`, Nemotron-3 `<think></think>`;
# or only its end, opening a turn (GLM-4.7 `</think>`, whose generation prompt opens `<think>`).
_EMPTY_THINK_BLOCK = re.compile(r"<think>\s*</think>\s*")
_CLOSED_AT_ONCE = re.compile(r"\s*</think>\s*")

Overlong = Literal["truncate", "drop"]


@dataclass(frozen=True)
class TokenizedDoc:
    """One tokenized conversation: ids and, per id, the loss weight of producing it (0 = not trained).

    `input_ids` / `loss_weights` are lists, or 1-D numpy arrays when read from the token cache.
    """

    input_ids: Sequence[int]
    loss_weights: Sequence[float]  # bools are accepted (True = 1.0)
    source: str = ""  # "path:line" of the row, for error messages
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def assistant_mask(self) -> list[bool]:
        return [bool(w > 0) for w in self.loss_weights]

    @property
    def num_loss_tokens(self) -> int:
        """Positions with a loss once labels are shifted: token i is predicted from i-1, so token 0 never is."""
        return int(np.count_nonzero(np.asarray(self.loss_weights[1:], dtype=np.float32)))

    @property
    def loss_weight_sum(self) -> float:
        """Σ of the shifted weights: this document's share of the loss normaliser."""
        return float(np.asarray(self.loss_weights[1:], dtype=np.float64).sum())


@dataclass(frozen=True)
class ChatOptions:
    """Everything besides the tokenizer that decides a conversation's tokens and weights."""

    max_seq_len: int = 2048
    overlong: str = "truncate"  # truncate | drop conversations longer than max_seq_len
    loss_on: str = "all_assistant"  # all_assistant | last_assistant (a message "weight" overrides)
    end_of_turn: str | None = None  # string closing every assistant turn; None = eos, a known one or a role tag
    chat_template: str | None = None  # template text; None = the tokenizer's
    close_last_turn: bool = True  # append the stop token (role tag) after a last turn the template leaves open
    empty_think: str = "train"  # train | mask the empty <think></think> blocks of trained turns

    def check(self) -> None:
        if self.overlong not in ("truncate", "drop"):
            raise ValueError(f"overlong={self.overlong!r} is not supported; use 'truncate' or 'drop'")
        if self.empty_think not in EMPTY_THINK:
            raise ValueError(f"empty_think={self.empty_think!r} is not supported; use one of {', '.join(EMPTY_THINK)}")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"loss_on={self.loss_on!r} is not supported; use one of {', '.join(LOSS_ON)}")
        if self.max_seq_len < 2:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} leaves nothing to learn; use at least 2 (typically 2048 or more)"
            )


def chat_template_of(tokenizer, options: ChatOptions) -> str:
    """The template text to render with: data.chat_template's, else the tokenizer's; DataFormatError if neither."""
    template = options.chat_template or tokenizer.chat_template
    if not template:
        raise DataFormatError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or '(in memory)'} has no chat template (no "
            "chat_template.jinja, no chat_template in tokenizer_config.json: a base model's tokenizer?); set "
            "data.tokenizer_path to an instruct model's tokenizer dir or data.chat_template to a .jinja template file"
        )
    return template


def has_generation_markers(chat_template: str | None) -> bool:
    return bool(chat_template) and _GENERATION_TAG.search(chat_template) is not None


def read_chat_template(path: str | Path | None) -> str | None:
    """The text of a template file a recipe names (data.chat_template), or None."""
    if path is None:
        return None
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"data.chat_template={str(path)!r} is not a file; give a .jinja template file or null")
    return path.read_text(encoding="utf-8")


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    max_seq_len: int,
    overlong: Overlong = "truncate",
    *,
    source: str = "",
    end_of_turn: str | None = None,
    loss_on: str = "all_assistant",
    tools: list | None = None,
    chat_template: str | None = None,
    close_last_turn: bool = True,
    empty_think: str = "train",
) -> TokenizedDoc | None:
    """Tokenize one conversation; None when it is dropped (overlong).

    overlong="truncate" keeps the first `max_seq_len` tokens; a conversation whose truncated part
    has no loss position left is dropped, as it would only cost compute. overlong="drop" drops
    every conversation longer than `max_seq_len`. Raises RowError (a DataFormatError) for a row
    the template cannot render or that has nothing to train on.
    """
    options = ChatOptions(max_seq_len, overlong, loss_on, end_of_turn, chat_template, close_last_turn, empty_think)
    options.check()
    return _tokenize(tokenizer, options, messages, tools, source)


def _tokenize(tokenizer, options: ChatOptions, messages: list[dict], tools, source: str) -> TokenizedDoc | None:
    rendered = render_conversation(tokenizer, options, messages, tools, source)
    encoding = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    return finish(rendered, encoding["input_ids"], encoding["offset_mapping"], options)


@dataclass(frozen=True)
class Rendered:
    """A conversation rendered by the template: its text and (start, end, loss weight) per trained span,
    plus token ids to append after the text's own (the stop token of a last turn the template leaves
    open, see `close_last_turn`) and their loss weight."""

    text: str
    spans: list[tuple[int, int, float]]
    source: str
    appended_ids: tuple[int, ...] = ()
    appended_weight: float = 0.0


def render_conversation(tokenizer, options: ChatOptions, messages: list[dict], tools, source: str) -> Rendered:
    """The rendered text and the character span of each assistant turn with its loss weight."""
    where = source or "conversation"
    template = chat_template_of(tokenizer, options)
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as apply_chat_template does
    weights = message_weights(messages, options.loss_on)
    plain = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    appended: tuple[int, ...] = ()
    try:
        if has_generation_markers(template):
            text, spans = spans_from_markers(tokenizer, template, plain, tools, weights, where)
        else:
            ends = [options.end_of_turn] if options.end_of_turn else _default_ends(tokenizer)
            role_tags = not options.end_of_turn  # an explicit end_of_turn must close every turn
            text, spans, open_last = spans_from_prefixes(tokenizer, template, plain, tools, ends, where, role_tags)
            if (late := content_after_turn(text, spans, plain)) is not None:
                raise RowError(
                    TEMPLATE_ERROR,
                    f"{where}: messages[{late}]: the chat template writes this message's content after its tool "
                    "calls' results, outside the turn its calls end, so it would not be trained; give that text "
                    "as the next assistant message (after the tool messages)",
                )
            if open_last and options.close_last_turn and weights[-1] > 0:
                appended = _last_turn_stop_ids(tokenizer, template, plain, tools, text, where)
    except TemplateError as e:  # e.g. the template's raise_exception("roles must alternate ...")
        raise RowError(TEMPLATE_ERROR, f"{where}: the chat template rejected this row: {e}") from e
    if not spans:
        raise RowError(
            TEMPLATE_ERROR,
            f"{where}: the chat template marked no assistant token; check that it renders "
            "assistant messages (and, if it uses {% generation %}, that the block wraps "
            "their content)",
        )
    weighted = [(s, e, weights[i]) for s, e, i in spans]
    if options.empty_think == "mask":
        weighted = without_empty_think(text, weighted)
    return Rendered(text, weighted, source, appended, weights[-1] if appended else 0.0)


def without_empty_think(text: str, spans: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """The trained spans less every empty `<think></think>` block (and the whitespace after it) that
    overlaps them (data.empty_think=mask).

    Templates write such a block into turns that have no reasoning (and into history turns whose
    reasoning they drop); trained, it teaches the model to close its reasoning at once, so a
    hybrid-reasoning model fine-tuned on answers without reasoning stops thinking when asked to
    think. Masked, the model still reads the block but is never taught to write it. A block that
    begins in the turn's header (Nemotron-3's generation prompt opens `<think>`), or a `</think>` the
    turn opens with (GLM-4.7 writes only that), is cut from where the span starts."""
    holes = [(m.start(), m.end()) for m in _EMPTY_THINK_BLOCK.finditer(text)]
    out = []
    for start, end, weight in spans:
        if closed := _CLOSED_AT_ONCE.match(text, start, end):
            start = closed.end()
        for a, b in holes:
            if b <= start or a >= end:
                continue
            if a > start:
                out.append((start, a, weight))
            start = max(start, b)
        if start < end:
            out.append((start, end, weight))
    return out


def _last_turn_stop_ids(
    tokenizer, template: str, messages: list[dict], tools, full: str, where: str
) -> tuple[int, ...]:
    """Ids of the role tag that would close the last (assistant) turn: the one the template writes
    after it when the message the model hands over to follows, a user message (GLM: `<|user|>`), or
    a tool result after a turn that calls tools (GLM: `<|observation|>`); see `turn_ends.handover_tag`."""
    calls = messages[-1].get("tool_calls") or []
    follower = {"role": "user", "content": _SENTINEL}
    if calls:
        call = calls[0] if isinstance(calls[0], dict) else {}
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        follower = {"role": "tool", "content": _SENTINEL, "tool_call_id": call.get("id"), "name": function.get("name")}
        follower = {k: v for k, v in follower.items() if v is not None}
    extended = _render(tokenizer, template, [*messages, follower], tools)
    tag = handover_tag(tokenizer, extended, full, messages[-1], f"{where}: messages[{len(messages) - 1}]")
    return tuple(tokenizer(tag, add_special_tokens=False)["input_ids"])


def finish(
    rendered: Rendered, input_ids: Sequence[int], offsets: Sequence[tuple[int, int]], options: ChatOptions
) -> TokenizedDoc | None:
    """Token weights from the spans (and the appended ids), then truncation or dropping by max_seq_len
    (None = dropped)."""
    token_weights = weights_from_spans(offsets, rendered.spans)
    token_weights += [rendered.appended_weight] * len(rendered.appended_ids)
    if not any(w > 0 for w in token_weights[1:]):
        raise RowError(
            NO_TRAINABLE_TOKENS,
            f"{rendered.source or 'conversation'}: no assistant token has a loss "
            f"weight > 0 (loss_on={options.loss_on}, message weights); nothing to learn",
        )
    ids, source = [*input_ids, *rendered.appended_ids], rendered.source
    if len(ids) <= options.max_seq_len:
        return TokenizedDoc(ids, token_weights, source)
    if options.overlong == "drop":
        return None
    doc = TokenizedDoc(ids[: options.max_seq_len], token_weights[: options.max_seq_len], source, truncated=True)
    return doc if doc.num_loss_tokens > 0 else None


def message_weights(messages: Sequence[dict], loss_on: str) -> list[float]:
    """Loss weight per message: 0 for non-assistant ones, the mode's default or the message's "weight"."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    last = assistants[-1] if assistants else -1
    out = []
    for i, m in enumerate(messages):
        default = 1.0 if m["role"] == "assistant" and (loss_on == "all_assistant" or i == last) else 0.0
        out.append(float(m.get("weight", default)) if m["role"] == "assistant" else 0.0)
    return out


def _default_ends(tokenizer) -> list[str]:
    return list(dict.fromkeys(t for t in (tokenizer.eos_token, *KNOWN_END_OF_TURN) if t))


def _render(
    tokenizer, template: str, messages: list[dict], tools, generation_prompt: bool = False, markers: bool = False
):
    """transformers' own renderer (what apply_chat_template calls), without its per-call wrapping."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=template,
        return_assistant_tokens_mask=markers,
        add_generation_prompt=generation_prompt,
        **tokenizer.special_tokens_map,
    )
    return (rendered[0], indices[0]) if markers else rendered[0]


def spans_from_markers(
    tokenizer, template: str, messages: list[dict], tools, weights: Sequence[float], where: str
) -> tuple[str, list[tuple[int, int, int]]]:
    """Rendered text and (start, end, message index) of each `{% generation %}` block."""
    text, blocks = _render(tokenizer, template, messages, tools, markers=True)
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(blocks) == len(assistants):
        return text, [(s, e, i) for (s, e), i in zip(blocks, assistants)]
    if len({weights[i] for i in assistants}) > 1:
        raise RowError(
            TEMPLATE_ERROR,
            f"{where}: the template has {len(blocks)} {{% generation %}} blocks for "
            f"{len(assistants)} assistant messages, so per-message weights (or "
            "loss_on=last_assistant) cannot be assigned; use equal weights",
        )
    return text, [(s, e, assistants[0]) for s, e in blocks]


def spans_from_prefixes(
    tokenizer, template: str, messages: list[dict], tools, ends: list[str], where: str, role_tags: bool = False
) -> tuple[str, list[tuple[int, int, int]], bool]:
    """Rendered text, (start, end, message index) of each assistant turn (see module doc), and
    whether the last message is an assistant turn left open: ended by the end of the text, not by
    an end-of-turn string.

    role_tags: a turn no end-of-turn string closes may end where the next message's role tag
    begins (GLM-4.5), see `turn_ends.end_at_role_tag`; templates that never write an end-of-turn string
    take that path directly, so a later turn's text cannot be mistaken for the end token.
    """
    full = _render(tokenizer, template, messages, tools)
    tagged = role_tags and not writes_end_of_turn(template, ends)
    spans, cursor, open_last = [], 0, False
    header: list[str] = []  # the generation prompt's text after a history, rendered when first needed

    def generation_header(i: int) -> str:
        if not header:
            bare = _render(tokenizer, template, messages[:i], tools)
            prompt = _render(tokenizer, template, messages[:i], tools, generation_prompt=True)
            header.append(prompt[len(bare) :] if prompt.startswith(bare) else "")
        return header[0]

    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise RowError(
                TEMPLATE_ERROR,
                f"{where}: messages[0] is an assistant message; without {{% generation %}} "
                "markers in the chat template its start cannot be found. Add a system or "
                "user message before it, or add the markers",
            )
        prefix = _render(tokenizer, template, messages[:i], tools, generation_prompt=True)
        if full.startswith(prefix) and len(prefix) >= cursor:
            start = len(prefix)
        else:
            start = _start_after_rerendered_history(tokenizer, template, messages, tools, i, full, cursor, ends, where)
        here = f"{where}: messages[{i}]"
        end = None if tagged else turn_end(full, start, ends, here, required=not role_tags)
        if end is not None and end < len(full) and (i + 1 == len(messages) or messages[i + 1]["role"] != "assistant"):
            end = continued_turn_end(full, end, ends, generation_header(i), here)
        if end is None:
            end = end_at_role_tag(
                tokenizer,
                lambda n: _render(tokenizer, template, messages[:n], tools),
                messages,
                i,
                full,
                start,
                ends,
                here,
            )
            # The last turn ran to the end of the text with no end-of-turn string closing it.
            open_last = i == len(messages) - 1 and end == len(full) and not any(full.endswith(e) for e in ends)
        spans.append((start, end, i))
        cursor = end
    return full, spans, open_last


def _start_after_rerendered_history(
    tokenizer, template: str, messages: list[dict], tools, i: int, full: str, cursor: int, ends: list[str], where: str
) -> int:
    """Where assistant turn `i` starts in `full` when the prefix render is not a prefix of it."""
    bare = _render(tokenizer, template, messages[:i], tools)
    prompt = _render(tokenizer, template, messages[:i], tools, generation_prompt=True)
    header = prompt[len(bare) :] if prompt.startswith(bare) else ""
    limit = _own_text_start(tokenizer, template, messages, tools, i, full)
    if header and limit < len(full):
        pos = full.rfind(header, cursor, limit)
        if pos >= 0:
            if messages[i - 1]["role"] != "assistant":  # else the segments before are the previous turn's
                pos = continued_turn_start(full, pos, ends, header, cursor)
            return pos + len(header)
        start = _start_after_partial_header(tokenizer, full, header, cursor, limit, ends)
        if start is not None:
            return start
    start = _start_after_aligned_history(full, bare, header, cursor, limit, messages[i - 1])
    if start is not None:
        return start
    raise RowError(
        TEMPLATE_ERROR,
        f"{where}: the chat template renders messages[:{i}] + generation prompt ({header!r}) differently "
        "from the full conversation (it rewrites earlier turns or opens the turn differently), and neither "
        "that prompt, a prefix of it, nor the end of the previous message could be found before the "
        "turn's text, so its tokens cannot be located; name a copy of the template with "
        "{% generation %}...{% endgeneration %} around the assistant output in data.chat_template",
    )


def _own_text_start(tokenizer, template: str, messages: list[dict], tools, i: int, full: str) -> int:
    """Where message i's own text starts in `full`: where a render with that text changed departs from it.

    Its content is replaced by a sentinel (`_render_probe`). A message with tool calls also gets its
    first call's arguments replaced, and the earlier departure counts: Gemma 4's template writes the
    calls before the content, each call's result after it inside the same model turn, so the content
    starts only after the results (and after `<|tool_response>`, the end string of the call)."""
    departures = [_departure(full, _render_probe(tokenizer, template, messages, tools, i))]
    if messages[i].get("tool_calls"):
        try:
            departures.append(_departure(full, _render_arguments_probe(tokenizer, template, messages, tools, i)))
        except TemplateError:
            pass  # a template that refuses changed arguments: the content's departure alone
    return min(departures)


def _departure(full: str, other: str) -> int:
    return next((k for k, (a, b) in enumerate(zip(full, other)) if a != b), min(len(full), len(other)))


def _render_probe(tokenizer, template: str, messages: list[dict], tools, i: int) -> str:
    """The conversation rendered with message i's own text changed: its content replaced by a sentinel,
    so the render departs from the full one where that text starts. A template may refuse that row:
    gpt-oss's raises for a tool-call message with both content and reasoning ("Cannot pass both
    content and thinking"); then the first tool call's arguments are replaced instead, which the
    template writes right after the call's header."""
    probe = [*messages[:i], {**messages[i], "content": _SENTINEL}, *messages[i + 1 :]]
    try:
        return _render(tokenizer, template, probe, tools)
    except TemplateError:
        calls = messages[i].get("tool_calls")
        if not calls or not isinstance(calls[0], dict):
            raise
        return _render_arguments_probe(tokenizer, template, messages, tools, i)


def _render_arguments_probe(tokenizer, template: str, messages: list[dict], tools, i: int) -> str:
    """The conversation rendered with the first tool call of message i given sentinel arguments."""
    calls = messages[i]["tool_calls"]
    call = calls[0] if isinstance(calls[0], dict) else {}
    inner = call.get("function") if isinstance(call.get("function"), dict) else call
    arguments = _SENTINEL if isinstance(inner.get("arguments"), str) else {"moe_sft_sentinel": _SENTINEL}
    changed = (
        {**call, "function": {**inner, "arguments": arguments}}
        if inner is not call
        else {**call, "arguments": arguments}
    )
    probe = [*messages[:i], {**messages[i], "tool_calls": [changed, *calls[1:]]}, *messages[i + 1 :]]
    return _render(tokenizer, template, probe, tools)


def _start_after_partial_header(
    tokenizer, full: str, header: str, cursor: int, limit: int, ends: list[str]
) -> int | None:
    """Turn start when the full text shows only a prefix of the generation prompt.

    A generation prompt that also opens a block the history shows otherwise or not at all
    (DeepSeek-R1's "<think>\n", MiniMax-M2's "]~b]ai\n<think>\n" before a turn without reasoning,
    Nemotron-3's "<|im_start|>assistant\n<think>\n" before the "<think></think>" it writes into a turn
    without reasoning): the longest prefix of it (at least half of it, or cut where an added token
    starts) whose last occurrence before the turn's text (`limit`) is followed by that text or by an
    added token, with no end-of-turn string in between. The turn starts after that prefix: what the
    template writes there beyond it (the `</think>` of "<think></think>") is the turn's, what the
    prompt would write is not.
    """
    for cut in range(len(header) - 1, 0, -1):
        if 2 * cut < len(header) and added_token_at(tokenizer, header, cut) is None:
            continue
        pos = full.rfind(header[:cut], cursor, limit)
        if pos < 0 or turn_end(full, pos + cut, ends, "", required=False, stop=limit) is not None:
            continue
        # Directly the turn's text, or a block the template opens with an added token (`</think>`);
        # plain text there would be a header the template writes differently, which is not trained.
        if pos + cut == limit or added_token_at(tokenizer, full, pos + cut) is not None:
            return pos + cut
    return None


def _start_after_aligned_history(
    full: str, bare: str, header: str, cursor: int, limit: int, previous: dict
) -> int | None:
    """Turn start for templates whose generation prompt is empty or absent from the history.

    Mistral's templates have no generation prompt and move the system prompt and the tools list to
    the last user message, so neither a prefix render nor a header marks the turn. The history
    render `bare` (messages[:i]) still ends with the previous message as the full text shows it:
    the turn starts where the longest common suffix of `bare` and `full[:s]` ends (s in
    [cursor, limit], the earliest on ties), after the generation prompt if there is one. The match
    must cover the previous message's text and be followed by the whole prompt, else None.
    """
    best, best_len = None, 0
    s = full.find(bare[-1], cursor, limit) if bare else -1
    while s >= 0:
        n = common_suffix(bare, full, s + 1)
        if n > best_len:
            best, best_len = s + 1, n
        s = full.find(bare[-1], s + 1, limit)
    content = previous.get("content")
    if best is None or (isinstance(content, str) and content.strip() not in bare[len(bare) - best_len :]):
        return None
    start = best + len(header)
    return start if full.startswith(header, best) and start <= limit else None


def weights_from_spans(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int, float]]) -> list[float]:
    """Per token: the weight of the sorted, disjoint span its character range overlaps, else 0."""
    if not len(offsets):
        return []
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts = np.array([s for s, _, _ in spans], dtype=np.int64)
    ends = np.array([e for _, e, _ in spans], dtype=np.int64)
    k = np.searchsorted(ends, bounds[:, 0], side="right")  # first span ending after the token starts
    inside = k < len(spans)
    k = np.minimum(k, len(spans) - 1)
    hit = inside & (bounds[:, 1] > starts[k]) & (bounds[:, 0] < ends[k]) if len(spans) else inside
    weights = np.array([w for _, _, w in spans] or [0.0], dtype=np.float64)
    return np.where(hit, weights[k] if len(spans) else 0.0, 0.0).tolist()


class RowTokenizer:
    """Rows (file records) → TokenizedDocs: decode, convert the format, validate, render, tokenize.

    Used by the cache builder's worker processes and by `tokenize_files`. `many` encodes the
    rendered texts of a chunk in one batched tokenizer call (less per-call overhead).
    """

    def __init__(self, tokenizer, options: ChatOptions, fmt: RowFormat | None = None):
        options.check()
        chat_template_of(tokenizer, options)  # once, before any row: every row would fail the same way
        self.tokenizer, self.options, self.fmt = tokenizer, options, fmt or RowFormat()

    def render(self, payload: object, where: str) -> Rendered:
        conversation = to_conversation(decode_payload(payload, where), self.fmt, where)
        return render_conversation(self.tokenizer, self.options, conversation.messages, conversation.tools, where)

    def __call__(self, payload: object, where: str) -> TokenizedDoc | None:
        rendered = self.render(payload, where)
        encoding = self.tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
        return finish(rendered, encoding["input_ids"], encoding["offset_mapping"], self.options)

    def many(self, records: Sequence[tuple[str, object]]) -> list[TokenizedDoc | None | RowError]:
        """Per (where, payload): the document, None (dropped), or the RowError it raised."""
        out: list = []
        for where, payload in records:
            try:
                out.append(self.render(payload, where))
            except RowError as e:
                out.append(e)
        texts = [r.text for r in out if isinstance(r, Rendered)]
        encodings = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else None
        k = 0
        for i, r in enumerate(out):
            if isinstance(r, Rendered):
                try:
                    out[i] = finish(r, encodings["input_ids"][k], encodings["offset_mapping"][k], self.options)
                except RowError as e:
                    out[i] = e
                k += 1
        return out


def tokenize_files(
    tokenizer,
    paths: Sequence[str | Path],
    max_seq_len: int,
    overlong: Overlong = "truncate",
    *,
    end_of_turn: str | None = None,
    loss_on: str = "all_assistant",
    fmt: RowFormat | None = None,
    close_last_turn: bool = True,
    empty_think: str = "train",
) -> tuple[list[TokenizedDoc], DataStats]:
    """Every row of `paths` tokenized in memory, fail-fast (small data and tests; training uses
    the on-disk cache of moe_sft.data.cache). Returns the kept documents and their statistics."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    options = ChatOptions(
        max_seq_len, overlong, loss_on, end_of_turn, close_last_turn=close_last_turn, empty_think=empty_think
    )
    rows = RowTokenizer(tokenizer, options, fmt)
    docs, stats = [], DataStats.empty(max_seq_len)
    for path in paths:
        for line, payload in iter_records(path):
            where = f"{path}:{line}"
            doc = rows(payload, where)
            stats.add_row(doc)
            if doc is not None:
                docs.append(doc)
    return docs, stats
