"""Where an assistant turn ends in a rendered conversation: an end-of-turn string, or (templates
that close no turn with one, GLM-4.5/4.6/4.7) the next message's role tag or the end of the text.
Pure string functions on the rendered text; moe_sft.data.chat finds the turns' starts and calls them.
"""

from __future__ import annotations

from moe_sft.data.formats import TEMPLATE_ERROR, RowError

# Strings that close an assistant turn besides the tokenizer's eos (the earliest after the turn's start
# wins, `turn_end`); each is a token the family's model emits to stop: ChatML `<|im_end|>`, Llama 3
# `<|eot_id|>`, harmony's (gpt-oss) segment ends `<|end|>` (reasoning, history) and `<|call|>` (tool
# call), Gemma 2/3 `<end_of_turn>`, Gemma 4 `<turn|>`, and Gemma 4's `<|tool_response>`, which ends a
# turn that calls tools: the template writes the tool's response after it inside the same model turn,
# and Gemma 4's generation_config stops on it (eos ids `<eos>`, `<turn|>`, `<|tool_response>`).
KNOWN_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|call|>", "<end_of_turn>", "<turn|>", "<|tool_response>")


def common_suffix(a: str, text: str, end: int) -> int:
    """Length of the longest common suffix of `a` and `text[:end]`: doubling while the suffixes match,
    then bisection (suffix equality is monotone), so the cost follows the match, not the text."""

    def match(n: int) -> bool:
        return a[len(a) - n :] == text[end - n : end]

    most, lo, hi = min(len(a), end), 0, 1
    while hi <= most and match(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, most + 1)  # the shortest length known not to match (most + 1: none)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if match(mid) else (lo, mid)
    return lo


def turn_end(text: str, start: int, ends: list[str], where: str, required: bool = True, stop: int | None = None):
    """Index just past the end-of-turn string closing the assistant turn that starts at `start`
    (searched in text[start:stop]); None when there is none and it is not `required`.

    Candidates are the eos token and known end-of-turn tokens, and the *earliest* one found wins:
    a base-model tokenizer (Qwen3 base: eos `<|endoftext|>`) ships a ChatML template whose turns
    end with `<|im_end|>`, while the eos may appear only later, or not at all.
    """
    stop = len(text) if stop is None else stop
    found = [(pos, end) for end in ends if (pos := text.find(end, start, stop)) >= 0]
    if not found:
        if not required:
            return None
        raise RowError(
            TEMPLATE_ERROR,
            f"{where}: the assistant turn is not closed by any of {ends}; set "
            "data.end_of_turn to your template's end-of-turn string",
        )
    pos, end = min(found)
    return pos + len(end)


def continued_turn_end(text: str, end: int, ends: list[str], header: str, where: str) -> int:
    """End of an assistant turn whose first segment ends at `end`, through the segments that continue it.

    The harmony format (gpt-oss) writes one assistant message as several segments, each opened by
    the generation prompt's header and closed by an end string: reasoning, then the answer
    (`<|start|>assistant<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final
    <|message|>…<|return|>`), or reasoning, then a tool call closed by `<|call|>`. The model writes
    every segment (generation stops at `<|return|>` or `<|call|>`, not at `<|end|>`), so an end
    string followed directly by the header again does not end the turn: the next segment's end
    string does. The caller asks this only when the next message is not an assistant message
    (whose own header would otherwise be taken for a continuation)."""
    while header and text.startswith(header, end):
        following = turn_end(text, end + len(header), ends, where, required=False)
        if following is None:
            break
        end = following
    return end


def continued_turn_start(text: str, header_pos: int, ends: list[str], header: str, floor: int) -> int:
    """Where the header of an assistant turn's first segment starts, given the header of one of its
    segments at `header_pos`: `continued_turn_end` backwards. A harmony turn found by its answer's
    header (`<|start|>assistant<|channel|>final...`) begins with the segments before it that the model
    also wrote (its reasoning, `<|start|>assistant<|channel|>analysis<|message|>...<|end|>`): each is
    the generation prompt's header followed by text that one end string closes right where the next
    segment's header starts. Segments are not searched before `floor` (the end of the previous
    assistant turn); the caller asks this only when the previous message is not an assistant message."""
    while header:
        before = text.rfind(header, floor, header_pos)
        if before < 0 or turn_end(text, before + len(header), ends, "", required=False, stop=header_pos) != header_pos:
            break
        header_pos = before
    return header_pos


def writes_end_of_turn(template: str, ends: list[str]) -> bool:
    """Whether the template source can write an end-of-turn string (literally or as `eos_token`)."""
    return "eos_token" in template or any(end in template for end in ends)


HANDOVER_ROLES = ("user", "tool")  # roles whose tag the model emits to end its turn (GLM's stop tokens)


def end_at_role_tag(
    tokenizer, render_history, messages: list[dict], i: int, full: str, start: int, ends: list[str], where: str
) -> int:
    """End of assistant turn `i` in a template that closes turns by the next role tag (GLM-4.5).

    The render of `messages[:i + 1]` (`render_history(i + 1)`) ends with turn i's own tail (content,
    tool calls) as the full text shows it, even where the full text drops the turn's reasoning: the
    turn's text ends where the longest common suffix of the two ends (`x`; the end of the text for
    the last message).
    An end-of-turn string inside the turn still closes it. Otherwise the next message's header
    starts at x with an added token, its role tag: it is trained when the next message is a user
    or tool message, as the model generates that tag to hand over (GLM-4.5 stops on `<|user|>` and
    `<|observation|>`; ms-swift trains both too). Before a system or assistant message the turn
    ends at x. The last turn ends with the text: the template writes nothing after it (chat.py
    appends the tag `handover_tag` finds, unless data.close_last_turn=false).
    """
    if i == len(messages) - 1:
        x = len(full)
    else:
        x = _aligned_end(full, render_history(i + 1), start, messages[i])
    end = None if x is None else turn_end(full, start, ends, where, required=False, stop=x)
    if end is not None:
        return end
    # The turn's text must run straight into the tag (or the end): a template that writes
    # whitespace there ("<end_of_msg>\n<start_of_msg>") closes turns with a token we do not
    # know, and guessing would train the wrong one.
    direct = x is not None and x > start and not full[x - 1].isspace()
    tag = added_token_at(tokenizer, full, x) if direct and x < len(full) else None
    if not direct or (tag is None and x < len(full)):
        raise RowError(
            TEMPLATE_ERROR,
            f"{where}: the assistant turn is not closed by any of {ends}, nor followed directly by a "
            "role tag (an added token of the tokenizer starting the next message) or the end of the "
            "text; set data.end_of_turn to your template's end-of-turn string",
        )
    if x == len(full):
        return x
    return x + len(tag) if messages[i + 1]["role"] in HANDOVER_ROLES else x


def handover_tag(tokenizer, extended: str, full: str, message: dict, where: str) -> str:
    """The role tag that closes the last assistant turn of `full` once a user message follows it.

    `extended` is the conversation rendered with a user message (a tool result after a turn that
    calls tools) appended. GLM's template writes nothing after the last turn, so that turn would
    train no stop token; the tag the model generates to hand over (`<|user|>`, `<|observation|>`)
    is the added token that starts where the turn's text (the
    longest common suffix of `full` and a prefix of `extended`: the template may re-render the
    turn, GLM drops its reasoning once a user message follows) ends in `extended`.
    """
    x = _aligned_end(extended, full, 0, message)
    direct = x is not None and x > 0 and not extended[x - 1].isspace()
    tag = added_token_at(tokenizer, extended, x) if direct and x < len(extended) else None
    if tag is None:
        raise RowError(
            TEMPLATE_ERROR,
            f"{where}: the last assistant turn ends with the text, and with a user (or tool) message after "
            "it the template does not follow it directly with a role tag (an added token of the tokenizer), so its "
            "stop token is unknown; set data.end_of_turn to your template's end-of-turn string, or "
            "data.close_last_turn=false to train no stop token after the last turn",
        )
    return tag


def _aligned_end(full: str, history: str, start: int, message: dict) -> int | None:
    """The x >= start where full[:x] shares the longest suffix with `history` (earliest on ties),
    provided that suffix holds the message's content; else None."""
    best, best_len = None, 0
    x = full.find(history[-1], start) if history else -1
    while x >= 0:
        n = common_suffix(history, full, x + 1)
        if n > best_len:
            best, best_len = x + 1, n
        x = full.find(history[-1], x + 1)
    content = message.get("content")
    shown = content.split("</think>")[-1].strip() if isinstance(content, str) else ""  # reasoning may be dropped
    if best is None or shown not in history[len(history) - best_len :]:
        return None
    return best


def added_token_at(tokenizer, text: str, pos: int) -> str | None:
    """The longest added token (special tokens, role tags) that `text` has at `pos`, or None."""
    hits = [t for t in tokenizer.get_added_vocab() if t and text.startswith(t, pos)]
    return max(hits, key=len) if hits else None


def content_after_turn(full: str, spans: list[tuple[int, int, int]], messages: list[dict]) -> int | None:
    """Index of the first message with tool calls whose content the template writes after its turn ends,
    before the next turn: none of the spans holds that text, though the model writes it. Gemma 4's
    template puts a calling message's content after the tools' results (the turn ends at
    `<|tool_response>`, where the model stops for them); None when every such content lies in its turn."""
    for k, (start, end, i) in enumerate(spans):
        content = messages[i].get("content")
        if not messages[i].get("tool_calls") or not isinstance(content, str):
            continue
        shown = content.split("</think>")[-1].split("<channel|>")[-1].strip()  # reasoning may be dropped
        stop = spans[k + 1][0] if k + 1 < len(spans) else len(full)
        if shown and shown not in full[start:end] and shown in full[end:stop]:
            return i
    return None
