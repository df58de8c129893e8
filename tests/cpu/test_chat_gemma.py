"""Gemma's chat templates masked exactly, with the templates themselves (tests/cpu/fixtures/chat_templates/,
provenance in docs/data.md), rendered on a copy of the demo tokenizer with Gemma's turn, channel and
tool tokens added as special tokens.

Gemma 2/3 (`gemma3.jinja`): `<bos>`, turns `<start_of_turn>user\\n...<end_of_turn>\\n` and
`<start_of_turn>model\\n...<end_of_turn>\\n`, the system prompt folded into the first user turn, no
tools. Gemma 4 (`gemma4.jinja`): `<|turn>system\\n...<turn|>\\n` (the system prompt and the tools list),
`<|turn>user\\n...`, `<|turn>model\\n...<turn|>\\n`; a turn that calls tools writes its reasoning
(`<|channel>thought\\n...<channel|>`, after the last user message only), its calls
(`<|tool_call>call:NAME{...}<tool_call|>`) and then the tool results (`<|tool_response>...<tool_response|>`)
inside the same model turn, which the answer continues. What is trained: each assistant turn from the
end of its header through its end token (`<end_of_turn>`, `<turn|>`, or `<|tool_response>` for the calls,
where Gemma 4 stops for the result), nothing else: not the header, the newline after the end token,
the system prompt, the tools list, user turns or tool results. Checked token by token against the
turns written out here, under all_assistant, last_assistant and per-message weights, with the ids
equal to `apply_chat_template`'s.
"""

from __future__ import annotations

import hashlib
import json
from itertools import groupby
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from moe_sft.data.chat import tokenize_conversation, tokenize_files
from moe_sft.data.formats import RowError

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"
CHAT_TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
GEMMA3_TEMPLATE = (CHAT_TEMPLATES / "gemma3.jinja").read_text(encoding="utf-8")
GEMMA4_TEMPLATE = (CHAT_TEMPLATES / "gemma4.jinja").read_text(encoding="utf-8")
# The later revision of Gemma 4's template (as vLLM's synced copy shows it) also opens an empty thought
# channel in the generation prompt when thinking is off; history turns are written without it.
_PROMPT = "        {{- '<|turn>model\\n' -}}\n    {%- endif -%}\n{%- endif -%}"
_PROMPT_WITH_EMPTY_THOUGHT = (
    "        {{- '<|turn>model\\n' -}}\n"
    "        {%- if not enable_thinking | default(false) -%}\n"
    "            {{- '<|channel>thought\\n<channel|>' -}}\n"
    "        {%- endif -%}\n    {%- endif -%}\n{%- endif -%}"
)
GEMMA4_EMPTY_THOUGHT_PROMPT_TEMPLATE = GEMMA4_TEMPLATE.replace(_PROMPT, _PROMPT_WITH_EMPTY_THOUGHT)
GEMMA3_TOKENS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA4_TOKENS = [
    *("<bos>", "<eos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", '<|"|>'),
    *("<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>"),
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _call(city: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


SYSTEM = {"role": "system", "content": "Answer briefly."}
CHAT = [
    SYSTEM,
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6.\nSure."},
]
# Reasoning, a call, its result, the answer (in the same model turn); a second query, two parallel calls
# without reasoning, two results, and the answer. The first call's reasoning is dropped once a later
# user message exists: it is trained only as rendered, in a row ending before that message.
AGENT = [
    SYSTEM,
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [_call("Paris", "c1")]},
    {"role": "tool", "content": "sky=sunny", "tool_call_id": "c1"},
    {"role": "assistant", "content": "Sunny in Paris."},
    {"role": "user", "content": "Rome and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("Rome", "c2"), _call("Oslo", "c3")]},
    {"role": "tool", "content": "sky=rainy", "tool_call_id": "c2"},
    {"role": "tool", "content": "sky=snow", "tool_call_id": "c3"},
    {"role": "assistant", "content": "Rome: rain. Oslo: snow."},
]
PARIS = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
ROME_OSLO = '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|><|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'

# name -> (template, tokens, eos, messages, tools, the trained text of each assistant turn)
CASES = {
    "gemma3_single_turn": (GEMMA3_TEMPLATE, GEMMA3_TOKENS, "<eos>", CHAT[1:3], None, ["4<end_of_turn>"]),
    "gemma3_system_folded": (GEMMA3_TEMPLATE, GEMMA3_TOKENS, "<eos>", CHAT[:3], None, ["4<end_of_turn>"]),
    "gemma3_multi_turn": (
        GEMMA3_TEMPLATE,
        GEMMA3_TOKENS,
        "<eos>",
        CHAT,
        None,
        ["4<end_of_turn>", "It is 6.\nSure.<end_of_turn>"],
    ),
    "gemma4_single_turn": (GEMMA4_TEMPLATE, GEMMA4_TOKENS, "<turn|>", CHAT[1:3], None, ["4<turn|>"]),
    "gemma4_system": (GEMMA4_TEMPLATE, GEMMA4_TOKENS, "<turn|>", CHAT[:3], None, ["4<turn|>"]),
    "gemma4_multi_turn": (
        GEMMA4_TEMPLATE,
        GEMMA4_TOKENS,
        "<turn|>",
        CHAT,
        None,
        ["4<turn|>", "It is 6.\nSure.<turn|>"],
    ),
    # Reasoning written inline: the template strips the thought channel from the content.
    "gemma4_inline_thought": (
        GEMMA4_TEMPLATE,
        GEMMA4_TOKENS,
        "<turn|>",
        [CHAT[1], {"role": "assistant", "content": "<|channel>thought\nadd<channel|>4"}],
        None,
        ["4<turn|>"],
    ),
    # The call is the last message: the template closes it with `<|tool_response>`, the stop token.
    "gemma4_call_last": (
        GEMMA4_TEMPLATE,
        GEMMA4_TOKENS,
        "<turn|>",
        AGENT[:3],
        [WEATHER_TOOL],
        [f"<|channel>thought\nNeed the tool.\n<channel|>{PARIS}<|tool_response>"],
    ),
    "gemma4_call_answer": (
        GEMMA4_TEMPLATE,
        GEMMA4_TOKENS,
        "<turn|>",
        AGENT[:5],
        [WEATHER_TOOL],
        [f"<|channel>thought\nNeed the tool.\n<channel|>{PARIS}<|tool_response>", "Sunny in Paris.<turn|>"],
    ),
    "gemma4_agent": (
        GEMMA4_TEMPLATE,
        GEMMA4_TOKENS,
        "<turn|>",
        AGENT,
        [WEATHER_TOOL],
        [
            f"{PARIS}<|tool_response>",
            "Sunny in Paris.<turn|>",
            f"{ROME_OSLO}<|tool_response>",
            "Rome: rain. Oslo: snow.<turn|>",
        ],
    ),
}
# The same rows on Gemma 4 with the later generation prompt, and with `<eos>` as the tokenizer's eos
# (a tokenizer_config some exports write): the masks do not change.
for _name in [n for n in CASES if n.startswith("gemma4")]:
    _template, _tokens, _eos, *_rest = CASES[_name]
    CASES[f"{_name}_empty_thought_prompt"] = (GEMMA4_EMPTY_THOUGHT_PROMPT_TEMPLATE, _tokens, _eos, *_rest)
    CASES[f"{_name}_eos"] = (_template, _tokens, "<eos>", *_rest)


def _tokenizer(template: str, tokens: list[str], eos: str):
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    tok.chat_template = template
    tok.add_tokens(tokens, special_tokens=True)
    tok.eos_token, tok.bos_token = eos, "<bos>"
    return tok


def _masked_runs(tok, doc) -> list[tuple[str, float]]:
    runs, pos = [], 0
    for weight, group in groupby(doc.loss_weights):
        n = len(list(group))
        if weight > 0:
            runs.append((tok.decode(doc.input_ids[pos : pos + n], skip_special_tokens=False), weight))
        pos += n
    return runs


def _expected_weights(tok, text: str, trained: list[str], weights: list[float]) -> list[float]:
    """Independent oracle: each turn's trained text, searched in order, is a character span; a token takes
    the weight of the span it lies in, and none straddles a span's edge."""
    spans, cursor = [], 0
    for want, w in zip(trained, weights):
        start = text.find(want, cursor)
        assert start >= cursor, (want, text[cursor:])
        cursor = start + len(want)
        spans.append((start, cursor, w))
    out = []
    for a, b in tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]:
        inside = [w for s, e, w in spans if s <= a and b <= e]
        assert inside or not any(a < e and b > s for s, e, _ in spans), f"token {text[a:b]!r} straddles a span"
        out.append(inside[0] if inside else 0.0)
    return out


def _weights(mode: str, n: int) -> tuple[list[float] | None, list[float]]:
    """(per-message weights to set or None, the weight each assistant turn is expected to get)."""
    if mode == "all_assistant":
        return None, [1.0] * n
    if mode == "last_assistant":
        return None, [0.0] * (n - 1) + [1.0]
    given = [(0.5, 0.0, 2.0, 1.5)[k % 4] for k in range(n - 1)] + [2.0]
    return given, given


@pytest.mark.parametrize("mode", ["all_assistant", "last_assistant", "per_message_weights"])
@pytest.mark.parametrize("name", list(CASES))
def test_gemma_templates_train_exactly_the_assistant_turns(name, mode):
    template, tokens, eos, messages, tools, trained = CASES[name]
    tok = _tokenizer(template, tokens, eos)
    given, expected = _weights(mode, len(trained))
    rows = [dict(m) for m in messages]
    if given:
        for m, w in zip([m for m in rows if m["role"] == "assistant"], given):
            m["weight"] = w
    loss_on = "last_assistant" if mode == "last_assistant" else "all_assistant"
    doc = tokenize_conversation(tok, rows, 4096, tools=tools, loss_on=loss_on)
    # Gemma's templates close every turn they write: nothing is appended, the ids are the template's.
    assert list(doc.input_ids) == list(tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False))
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert list(doc.loss_weights) == _expected_weights(tok, text, trained, expected)
    assert _masked_runs(tok, doc) == [(t, w) for t, w in zip(trained, expected) if w > 0]
    # Nothing of the system prompt, the tools list, user turns or tool results is trained.
    trained_text = "".join(t for t, _ in _masked_runs(tok, doc))
    for m in messages:
        if m["role"] != "assistant" and m.get("content"):
            assert m["content"] not in trained_text, m
    assert "Weather of a city" not in trained_text and "response:" not in trained_text


def test_gemma3_folds_the_system_prompt_and_refuses_tool_turns():
    tok = _tokenizer(GEMMA3_TEMPLATE, GEMMA3_TOKENS, "<eos>")
    text = tok.apply_chat_template(CHAT[:3], tokenize=False)
    assert text == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
    )
    # Gemma 3's template has no tool role (roles must alternate): the row fails, named.
    with pytest.raises(RowError, match=r"^g\.jsonl:3: the chat template rejected this row: .*alternate"):
        tokenize_conversation(tok, AGENT[:5], 4096, source="g.jsonl:3")


def test_gemma4_turn_that_calls_tools_ends_at_its_stop_token():
    """The call turn's span ends at `<|tool_response>` and the answer's starts after the last result:
    the results the template writes between them, inside the same model turn, are not trained."""
    tok = _tokenizer(GEMMA4_TEMPLATE, GEMMA4_TOKENS, "<turn|>")
    doc = tokenize_conversation(tok, AGENT[:5], 4096, tools=[WEATHER_TOOL])
    text = tok.apply_chat_template(AGENT[:5], tools=[WEATHER_TOOL], tokenize=False)
    assert '<|tool_response>response:get_weather{value:<|"|>sky=sunny<|"|>}<tool_response|>Sunny in Paris.' in text
    untrained = "".join(
        tok.decode([t], skip_special_tokens=False) for t, w in zip(doc.input_ids, doc.loss_weights) if w == 0
    )
    assert "response:get_weather{value:" in untrained and "sky=sunny" in untrained
    # An explicit data.end_of_turn must close every turn: `<turn|>` does not close the call turn alone.
    with pytest.raises(RowError):
        tokenize_conversation(tok, AGENT[:5], 4096, tools=[WEATHER_TOOL], end_of_turn="<turn|>")


def test_gemma_templates_are_the_pinned_files():
    """The fixtures byte for byte (sha256; sizes 1,532 and 16,317 B); docs/data.md says where they come from."""
    assert hashlib.sha256(GEMMA3_TEMPLATE.encode()).hexdigest() == (
        "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4"
    )
    assert hashlib.sha256(GEMMA4_TEMPLATE.encode()).hexdigest() == (
        "781d10940fbc44be40064b5d43a056fc486c84ceaa55538226368b57314132bf"
    )
    assert GEMMA4_EMPTY_THOUGHT_PROMPT_TEMPLATE.count("<|channel>thought\\n<channel|>") == 1


def test_gemma4_tool_responses_inside_an_assistant_message_are_refused(tmp_path):
    """Gemma's native layout puts the results on the calling message; the template writes them between
    the calls and the answer, inside one model turn, so the row is refused, naming the fix."""
    tok = _tokenizer(GEMMA4_TEMPLATE, GEMMA4_TOKENS, "<turn|>")
    native = {
        **AGENT[2],
        "content": "Sunny in Paris.",
        "tool_responses": [{"name": "get_weather", "response": {"sky": "sunny"}}],
    }
    path = tmp_path / "native.jsonl"
    path.write_text(json.dumps({"messages": [AGENT[1], native], "tools": [WEATHER_TOOL]}) + "\n", encoding="utf-8")
    with pytest.raises(RowError, match=r"native\.jsonl:1: .*tool_responses.*give each result as a tool message"):
        tokenize_files(tok, path, 4096)


def test_gemma4_content_of_a_calling_message_is_refused():
    """Gemma 4's template writes a calling message's content after the tools' results, where no turn
    holds it: refused rather than left untrained; as the next assistant message it is trained."""
    tok = _tokenizer(GEMMA4_TEMPLATE, GEMMA4_TOKENS, "<turn|>")
    rows = [AGENT[1], {**AGENT[2], "content": "Let me check."}, AGENT[3]]
    with pytest.raises(RowError, match=r"^a\.jsonl:1: messages\[1\]: .*content after its tool calls' results"):
        tokenize_conversation(tok, rows, 4096, tools=[WEATHER_TOOL], source="a.jsonl:1")
    moved = [AGENT[1], AGENT[2], AGENT[3], {"role": "assistant", "content": "Let me check."}]
    doc = tokenize_conversation(tok, moved, 4096, tools=[WEATHER_TOOL])
    assert _masked_runs(tok, doc)[-1] == ("Let me check.<turn|>", 1.0)
