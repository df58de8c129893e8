"""Assistant-only loss weights from chat templates: generation markers and prefix diff, on the demo
template and on real-world-style templates written here (ChatML/Qwen2.5 with tools, Llama 3 headers,
Qwen3 that strips earlier turns' reasoning, Mistral v0.3 [INST] with tools and no generation prompt,
Mixtral [INST], DeepSeek-R1 whose generation prompt opens a think block), each under all_assistant,
last_assistant and per-message weights, against an independent per-token oracle."""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from moe_sft.data.chat import (
    _render,
    has_generation_markers,
    tokenize_conversation,
    tokenize_files,
    weights_from_spans,
)
from moe_sft.data.formats import NO_TRAINABLE_TOKENS, TEMPLATE_ERROR, DataFormatError, RowError
from moe_sft.data.turn_ends import common_suffix as _common_suffix

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Reverse: cat dog sun"},
    {"role": "assistant", "content": "Reversed: sun dog cat"},
    {"role": "user", "content": "Reverse: owl fox egg"},
    {"role": "assistant", "content": "Reversed: egg fox owl"},
]

# Like Qwen3's template: turns after the last user message get an (empty) think block, earlier
# ones do not, so rendering a prefix is not a prefix of the full render for every cut.
QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _load(template: str | None = None):
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tok():
    return _load()


@pytest.fixture(scope="module")
def tok_plain(tok):
    """The demo template with the {% generation %} markers removed: forces the prefix-diff path."""
    plain = tok.chat_template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    assert plain != tok.chat_template
    return _load(plain)


def masked_runs(tok, doc, with_weights: bool = False) -> list:
    """Decoded text of each maximal run of tokens with the same loss weight > 0 (and the weight)."""
    runs, pos = [], 0
    for weight, group in groupby(doc.loss_weights):
        n = len(list(group))
        if weight > 0:
            text = tok.decode(doc.input_ids[pos : pos + n], skip_special_tokens=False)
            runs.append((text, weight) if with_weights else text)
        pos += n
    return runs


def test_demo_tokenizer_is_the_committed_one(tok):
    assert len(tok) == 688
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert has_generation_markers(tok.chat_template)


@pytest.mark.parametrize("which", ["markers", "prefix_diff"])
def test_mask_is_exactly_assistant_content_and_end_token(tok, tok_plain, which):
    tokenizer = tok if which == "markers" else tok_plain
    doc = tokenize_conversation(tokenizer, CONVERSATION, max_seq_len=1024)
    assert masked_runs(tokenizer, doc) == ["Reversed: sun dog cat<|im_end|>", "Reversed: egg fox owl<|im_end|>"]
    assert len(doc) == 51
    assert [i for i, m in enumerate(doc.assistant_mask) if m] == [24, 25, 26, 27, 28, 29, 44, 45, 46, 47, 48, 49]
    assert doc.num_loss_tokens == 12
    rendered = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(doc.input_ids, skip_special_tokens=False) == rendered
    assert doc.truncated is False and doc.source == ""


def test_marker_and_prefix_paths_agree_on_demo_data(tok, tok_plain):
    rows = [json.loads(line)["messages"] for line in (DEMO / "data" / "train.jsonl").open()][:150]
    rows.append(  # tool role, non-ASCII content, a system-then-assistant opening
        [
            {"role": "system", "content": "Greet first."},
            {"role": "assistant", "content": "Héllo ✓"},
            {"role": "user", "content": "call the tool"},
            {"role": "tool", "content": '{"ok": true}'},
            {"role": "assistant", "content": ""},
        ]
    )
    n_multi_turn = 0
    for messages in rows:
        a = tokenize_conversation(tok, messages, 1024)
        b = tokenize_conversation(tok_plain, messages, 1024)
        assert a.input_ids == b.input_ids
        assert a.assistant_mask == b.assistant_mask
        expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert masked_runs(tok, a) == expected
        n_multi_turn += len(expected) > 1
    assert n_multi_turn > 10  # the demo data does exercise multi-turn rows


def test_prefix_diff_trains_on_template_inserted_think_block():
    tokenizer = _load(QWEN3_LIKE_TEMPLATE)
    assert not has_generation_markers(tokenizer.chat_template)
    doc = tokenize_conversation(tokenizer, CONVERSATION[1:], max_seq_len=1024)
    # The earlier turn is plain; the last one carries the empty think block the model must emit.
    assert masked_runs(tokenizer, doc) == [
        "Reversed: sun dog cat<|im_end|>",
        "<think>\n\n</think>\n\nReversed: egg fox owl<|im_end|>",
    ]


def test_prefix_diff_rejects_templates_that_rewrite_history():
    tokenizer = _load(
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + ' ' + (messages|length)|string + '\\n' "
        "+ m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    with pytest.raises(DataFormatError, match=r"train\.jsonl:7: .*renders messages\[:1\].*generation"):
        tokenize_conversation(tokenizer, CONVERSATION[1:], 1024, source="train.jsonl:7")


MISTRAL_LIKE_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{- '[INST] ' + m['content'] + ' [/INST]' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- ' ' + m['content'] + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


def test_prefix_diff_end_of_turn_is_eos_or_im_end(tok_plain):
    # Base-model setup (Qwen3 base): eos is <|endoftext|> but ChatML turns end with <|im_end|>.
    base = _load(tok_plain.chat_template)
    base.eos_token = "<|endoftext|>"
    doc = tokenize_conversation(base, CONVERSATION, 1024)
    assert masked_runs(base, doc) == ["Reversed: sun dog cat<|im_end|>", "Reversed: egg fox owl<|im_end|>"]
    # Mistral-style: no ChatML at all, assistant turns end with eos; no generation prompt either.
    mistral = _load(MISTRAL_LIKE_TEMPLATE)
    mistral.eos_token = "<|endoftext|>"
    doc = tokenize_conversation(mistral, CONVERSATION[1:], 1024)
    assert masked_runs(mistral, doc) == [" Reversed: sun dog cat<|endoftext|>", " Reversed: egg fox owl<|endoftext|>"]
    with pytest.raises(DataFormatError, match=r"messages\[1\]: .*not closed by any of \['</s>'\].*data\.end_of_turn"):
        tokenize_conversation(mistral, CONVERSATION[1:], 1024, end_of_turn="</s>")


def test_template_exceptions_name_the_row():
    tokenizer = _load(
        "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- raise_exception('System role not supported') -}}"
        "{%- endif -%}{{- m['content'] + eos_token -}}{%- endfor -%}"
    )
    with pytest.raises(DataFormatError, match=r"^a\.jsonl:3: the chat template rejected this row: System role not"):
        tokenize_conversation(tokenizer, CONVERSATION, 1024, source="a.jsonl:3")


def test_truncate_and_drop(tok):
    full = tokenize_conversation(tok, CONVERSATION, 1024)
    cut = tokenize_conversation(tok, CONVERSATION, 40)
    assert cut.truncated and len(cut) == 40
    assert cut.input_ids == full.input_ids[:40] and cut.assistant_mask == full.assistant_mask[:40]
    assert cut.num_loss_tokens == 6  # only the first answer survives
    assert tokenize_conversation(tok, CONVERSATION, 40, overlong="drop") is None
    assert tokenize_conversation(tok, CONVERSATION, 51, overlong="drop").input_ids == full.input_ids
    # Cut before the first answer: nothing left to learn, so the row is dropped.
    assert tokenize_conversation(tok, CONVERSATION, 20) is None
    with pytest.raises(ValueError, match="overlong='pad'"):
        tokenize_conversation(tok, CONVERSATION, 40, overlong="pad")


def test_tokenize_files_counts(tok, tmp_path):
    path = tmp_path / "mini.jsonl"
    path.write_text(
        "\n".join(json.dumps({"messages": m}) for m in (CONVERSATION, CONVERSATION[1:3], CONVERSATION[:3])) + "\n"
    )
    docs, stats = tokenize_files(tok, [path], max_seq_len=40)
    assert [len(d) for d in docs] == [40, 20, 31]
    assert (stats.rows, stats.samples, stats.truncated, stats.dropped, stats.tokens, stats.loss_tokens) == (
        3,
        3,
        1,
        0,
        91,
        18,
    )
    assert stats.histogram[:2] == [2, 1]  # 20 and 31 tokens <= 32; 40 in 33-40
    assert docs[1].source == f"{path}:2"
    docs, stats = tokenize_files(tok, [path], max_seq_len=40, overlong="drop")
    assert (stats.rows, stats.samples, stats.truncated, stats.dropped, stats.tokens, stats.loss_tokens) == (
        3,
        2,
        0,
        1,
        51,
        12,
    )


# ----------------------------------------------------------------------------- loss modes and weights


@pytest.mark.parametrize("which", ["markers", "prefix_diff"])
def test_last_turn_only_and_per_message_weights(tok, tok_plain, which):
    tokenizer = tok if which == "markers" else tok_plain
    last = tokenize_conversation(tokenizer, CONVERSATION, 1024, loss_on="last_assistant")
    assert masked_runs(tokenizer, last, with_weights=True) == [("Reversed: egg fox owl<|im_end|>", 1.0)]
    weighted = [dict(m) for m in CONVERSATION]
    weighted[2]["weight"], weighted[4]["weight"] = 0.25, 2.0
    doc = tokenize_conversation(tokenizer, weighted, 1024)
    assert masked_runs(tokenizer, doc, with_weights=True) == [
        ("Reversed: sun dog cat<|im_end|>", 0.25),
        ("Reversed: egg fox owl<|im_end|>", 2.0),
    ]
    assert doc.loss_weight_sum == pytest.approx(6 * 0.25 + 6 * 2.0) and doc.num_loss_tokens == 12
    # An explicit weight wins over last_assistant; weight 0 everywhere leaves nothing to learn.
    weighted[4]["weight"] = 0.0
    doc = tokenize_conversation(tokenizer, weighted, 1024, loss_on="last_assistant")
    assert masked_runs(tokenizer, doc, with_weights=True) == [("Reversed: sun dog cat<|im_end|>", 0.25)]
    weighted[2]["weight"] = 0
    with pytest.raises(RowError, match=r"^row\.jsonl:9: no assistant token has a loss weight > 0") as err:
        tokenize_conversation(tokenizer, weighted, 1024, source="row.jsonl:9")
    assert err.value.category == NO_TRAINABLE_TOKENS


# ----------------------------------------------------------------------------- real-world-style templates


def _with_tokens(tokens: list[str], template: str, eos: str | None = None, bos: str | None = None):
    tokenizer = _load(template)
    tokenizer.add_tokens(tokens, special_tokens=True)
    if eos:
        tokenizer.eos_token = eos
    if bos:
        tokenizer.bos_token = bos
    return tokenizer


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
AGENT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": '{"sky": "sunny"}'},
    {"role": "assistant", "content": "It is sunny in Paris.", "reasoning_content": "The tool says sunny."},
    {"role": "user", "content": "Thanks! And tomorrow?"},
    {"role": "assistant", "content": "I cannot forecast.", "reasoning_content": "No forecast tool."},
]
CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

# Qwen2.5's template (ChatML, tools in the system turn, tool calls inline, tool results as user turns).
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}"
    "{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1's layout: bos, header blocks, a dated system block, trimmed content, <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}{{- tool_call.arguments | tojson }}'
    "{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{{- message.content }}{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Qwen3's template (abridged to its message loop): reasoning is shown only for assistant turns after
# the last real user query; earlier turns are re-rendered without it.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}"
    "{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}"
    "{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# DeepSeek-R1's: the reasoning of every assistant turn is cut at </think>; the generation prompt
# opens a think block that the rendered history never shows.
R1_TEMPLATE = (
    "{% set ns = namespace(system_prompt='') %}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<｜User｜>' + message['content'] }}{% elif message['role'] == 'assistant' %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)


def _prefix_matches(tokenizer, messages, i, tools=None) -> bool:
    full = _render(tokenizer, tokenizer.chat_template, messages, tools)
    return full.startswith(_render(tokenizer, tokenizer.chat_template, messages[:i], tools, generation_prompt=True))


def test_chatml_qwen25_template_with_tool_calls():
    tokenizer = _load(QWEN25_TEMPLATE)
    messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in AGENT]
    doc = tokenize_conversation(tokenizer, messages, 4096, tools=[WEATHER_TOOL])
    text = tokenizer.decode(doc.input_ids, skip_special_tokens=False)
    assert '<tools>\n{"type": "function"' in text and '<tool_response>\n{"sky": "sunny"}' in text
    # The tool call is produced by the model (trained); the tool's answer and the tools list are not.
    assert masked_runs(tokenizer, doc) == [
        f"<tool_call>\n{CALL_JSON}\n</tool_call><|im_end|>",
        "It is sunny in Paris.<|im_end|>",
        "I cannot forecast.<|im_end|>",
    ]


def test_llama3_header_template_trims_content():
    tokenizer = _with_tokens(
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        LLAMA3_TEMPLATE,
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",
    )
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["content"] = "  Reversed: sun dog cat \n"  # the template trims; the mask follows the text
    doc = tokenize_conversation(tokenizer, messages, 4096)
    text = tokenizer.decode(doc.input_ids, skip_special_tokens=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge")
    assert masked_runs(tokenizer, doc) == ["Reversed: sun dog cat<|eot_id|>", "Reversed: egg fox owl<|eot_id|>"]
    call = [AGENT[1], {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}, AGENT[3], AGENT[4]]
    doc = tokenize_conversation(tokenizer, call, 4096)
    assert masked_runs(tokenizer, doc) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "It is sunny in Paris.<|eot_id|>",
    ]


def test_qwen3_template_that_strips_earlier_reasoning():
    tokenizer = _load(QWEN3_TEMPLATE)
    doc = tokenize_conversation(tokenizer, AGENT, 4096)
    text = tokenizer.decode(doc.input_ids, skip_special_tokens=False)
    # History (before the last user query) is re-rendered without its reasoning ...
    assert "I should call the tool." not in text and "The tool says sunny." not in text
    # ... while the prefix the model saw when writing turn 4 still had it: the plain prefix diff fails here.
    assert not _prefix_matches(tokenizer, AGENT, 4)
    assert masked_runs(tokenizer, doc) == [
        f"<tool_call>\n{CALL_JSON}\n</tool_call><|im_end|>",
        "It is sunny in Paris.<|im_end|>",
        "<think>\nNo forecast tool.\n</think>\n\nI cannot forecast.<|im_end|>",
    ]
    # Reasoning written inline in the content (no reasoning_content field) is handled the same way.
    inline = [dict(m) for m in AGENT]
    for m in inline:
        if m["role"] == "assistant":
            m["content"] = f"<think>\n{m.pop('reasoning_content')}\n</think>\n\n{m['content']}"
    assert masked_runs(tokenizer, tokenize_conversation(tokenizer, inline, 4096)) == masked_runs(tokenizer, doc)


def test_qwen3_empty_think_block_is_trained_or_masked():
    """Qwen3 writes `<think>\n\n</think>\n\n` into a last turn without reasoning: trained by default
    (data.empty_think=train), not trained with empty_think=mask; the ids are the same either way."""
    tokenizer = _load(QWEN3_TEMPLATE)
    train = tokenize_conversation(tokenizer, PLAIN_AGENT, 4096)
    mask = tokenize_conversation(tokenizer, PLAIN_AGENT, 4096, empty_think="mask")
    assert list(mask.input_ids) == list(train.input_ids)
    history = [f"<tool_call>\n{CALL_JSON}\n</tool_call><|im_end|>", "It is sunny in Paris.<|im_end|>"]
    assert masked_runs(tokenizer, train) == [*history, "<think>\n\n</think>\n\nI cannot forecast.<|im_end|>"]
    assert masked_runs(tokenizer, mask) == [*history, "I cannot forecast.<|im_end|>"]
    # Reasoning that is there is trained in both modes.
    with_reasoning = tokenize_conversation(tokenizer, AGENT, 4096, empty_think="mask")
    assert (
        masked_runs(tokenizer, with_reasoning)[-1]
        == "<think>\nNo forecast tool.\n</think>\n\nI cannot forecast.<|im_end|>"
    )


def test_deepseek_r1_template_whose_prompt_opens_a_think_block():
    tokenizer = _with_tokens(
        ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"],
        R1_TEMPLATE,
        eos="<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
    )
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"},
    ]
    assert not _prefix_matches(tokenizer, messages, 1)
    doc = tokenize_conversation(tokenizer, messages, 4096)
    assert masked_runs(tokenizer, doc) == ["\n\n4<｜end▁of▁sentence｜>", "\n\n6<｜end▁of▁sentence｜>"]


# Mistral-7B-Instruct-v0.3's: no generation prompt; the tools list goes before the *last* user
# message and the system prompt into it only when it ends the conversation (inference), so every
# earlier turn renders differently in a prefix: neither the prefix diff nor a header finds the turns.
MISTRAL_V3_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools is not none and (message == user_messages[-1]) %}{{- '[AVAILABLE_TOOLS] [' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}"
    "{{- '][/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}{{- out[:-1] }}"
    "{{- ', \\\"id\\\": \\\"' + tool_call.id + '\\\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\\\"content\\\": ' + message.content|string + ', ' }}"
    "{{- '\\\"call_id\\\": \\\"' + message.tool_call_id + '\\\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported') }}{%- endif %}"
    "{%- endfor %}"
)

# Mixtral-8x7B-Instruct's: the system prompt joins the first user message, roles must alternate.
MIXTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{%- if loop.first and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

THIRD_TURN = [AGENT[5], AGENT[6]]
PLAIN_AGENT = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in AGENT]
MISTRAL_AGENT = [
    *PLAIN_AGENT[:2],
    {"role": "assistant", "content": "", "tool_calls": [{**TOOL_CALL, "id": "call00001"}]},
    {**PLAIN_AGENT[3], "tool_call_id": "call00001"},
    *PLAIN_AGENT[4:],
]
R1_CHAT = [
    {"role": "system", "content": "Think step by step."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"},
    {"role": "user", "content": "4+4?"},
    {"role": "assistant", "content": "<think>\nonce more\n</think>\n\n8"},
]

# name: (special tokens, template, eos, bos, messages, tools, the trained text of each assistant turn).
# The trained text is the assistant's output as rendered (reasoning where the template keeps it, tool
# calls) plus the end-of-turn token; never a role header, system/user/tool text or the tools list.
REAL_WORLD = {
    "qwen3_strips_reasoning": (
        [],
        QWEN3_TEMPLATE,
        None,
        None,
        AGENT,
        None,
        [
            f"<tool_call>\n{CALL_JSON}\n</tool_call><|im_end|>",
            "It is sunny in Paris.<|im_end|>",
            "<think>\nNo forecast tool.\n</think>\n\nI cannot forecast.<|im_end|>",
        ],
    ),
    "qwen25_tools": (
        [],
        QWEN25_TEMPLATE,
        None,
        None,
        PLAIN_AGENT,
        [WEATHER_TOOL],
        [
            f"<tool_call>\n{CALL_JSON}\n</tool_call><|im_end|>",
            "It is sunny in Paris.<|im_end|>",
            "I cannot forecast.<|im_end|>",
        ],
    ),
    "llama3_headers": (
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        LLAMA3_TEMPLATE,
        "<|eot_id|>",
        "<|begin_of_text|>",
        PLAIN_AGENT,
        None,
        [
            '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
            "It is sunny in Paris.<|eot_id|>",
            "I cannot forecast.<|eot_id|>",
        ],
    ),
    "mistral_v3_tools": (
        [
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        MISTRAL_V3_TEMPLATE,
        "</s>",
        "<s>",
        MISTRAL_AGENT,
        [WEATHER_TOOL],
        [
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>',
            " It is sunny in Paris.</s>",
            " I cannot forecast.</s>",
        ],
    ),
    "mixtral_inst": (
        ["<s>", "</s>", "[INST]", "[/INST]"],
        MIXTRAL_TEMPLATE,
        "</s>",
        "<s>",
        [*CONVERSATION, *THIRD_TURN],
        None,
        [" Reversed: sun dog cat</s>", " Reversed: egg fox owl</s>", " I cannot forecast.</s>"],
    ),
    "deepseek_r1": (
        ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"],
        R1_TEMPLATE,
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>",
        R1_CHAT,
        None,
        ["\n\n4<｜end▁of▁sentence｜>", "\n\n6<｜end▁of▁sentence｜>", "\n\n8<｜end▁of▁sentence｜>"],
    ),
}
MODES = {
    "all_assistant": (None, [1.0, 1.0, 1.0]),
    "last_assistant": (None, [0.0, 0.0, 1.0]),
    "per_message_weights": ([0.5, 0.0, 2.0], [0.5, 0.0, 2.0]),
}


def _expected_token_weights(tokenizer, text: str, messages, trained: list[str], weights: list[float]):
    """Independent of the span finder: each assistant turn's expected trained text, searched for after
    the text of the message before it (pinning it to its turn), gives a character span; a token takes
    its span's weight. Also checks that no token straddles a span boundary."""
    spans, cursor, turns = [], 0, iter(zip(trained, weights))
    for m in messages:
        if m["role"] == "assistant":
            want, w = next(turns)
            start = text.find(want, cursor)
            assert start >= cursor, (want, text[cursor:])
            cursor = start + len(want)
            spans.append((start, cursor, w))
        elif isinstance(m.get("content"), str) and (pos := text.find(m["content"].strip(), cursor)) >= 0:
            cursor = pos + len(m["content"].strip())  # a prompt text the template renders (Mistral may drop it)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for a, b in encoding["offset_mapping"]:
        inside = [w for s, e, w in spans if s <= a and b <= e]
        assert inside or not any(a < e and b > s for s, e, _ in spans), f"token {text[a:b]!r} straddles a span"
        out.append(inside[0] if inside else 0.0)
    return encoding["input_ids"], out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(REAL_WORLD))
def test_real_world_templates_train_exactly_the_assistant_turns(name, mode):
    tokens, template, eos, bos, messages, tools, trained = REAL_WORLD[name]
    tokenizer = _with_tokens(tokens, template, eos=eos, bos=bos)
    message_weights, expected = MODES[mode]
    rows = [dict(m) for m in messages]
    if message_weights:
        for m, w in zip([m for m in rows if m["role"] == "assistant"], message_weights):
            m["weight"] = w
    loss_on = "last_assistant" if mode == "last_assistant" else "all_assistant"
    doc = tokenize_conversation(tokenizer, rows, 4096, tools=tools, loss_on=loss_on)
    # The ids are the template's own rendering (transformers' apply_chat_template), whatever the mode.
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert tokenizer.decode(doc.input_ids, skip_special_tokens=False) == text
    ids, weights = _expected_token_weights(tokenizer, text, messages, trained, expected)
    assert list(doc.input_ids) == ids and list(doc.loss_weights) == weights
    assert masked_runs(tokenizer, doc, with_weights=True) == [(t, w) for t, w in zip(trained, expected) if w > 0]
    # Nothing of the prompt side is trained: system, user and tool texts, and the tools list.
    trained_text = "".join(masked_runs(tokenizer, doc))
    for m in messages:
        if m["role"] != "assistant" and m.get("content"):
            assert m["content"] not in trained_text, m
    assert "Weather of a city" in text if tools else True
    assert "Weather of a city" not in trained_text


def test_mistral_v3_history_is_not_a_prefix_and_the_system_prompt_moves():
    tokens, template, eos, bos, messages, tools, _ = REAL_WORLD["mistral_v3_tools"]
    tokenizer = _with_tokens(tokens, template, eos=eos, bos=bos)
    assert not _prefix_matches(tokenizer, messages, 2, tools) and not _prefix_matches(tokenizer, messages, 4, tools)
    # The turn still is found when its content is not rendered at all (a tool-call-only turn).
    doc = tokenize_conversation(tokenizer, messages[:3], 4096, tools=tools)
    assert masked_runs(tokenizer, doc) == [REAL_WORLD["mistral_v3_tools"][6][0]]


def test_template_errors_are_row_errors():
    tokenizer = _load(QWEN25_TEMPLATE)
    with pytest.raises(RowError, match=r"^x\.jsonl:2: .*not closed by any of \['<END>'\]") as err:
        tokenize_conversation(tokenizer, CONVERSATION, 1024, source="x.jsonl:2", end_of_turn="<END>")
    assert err.value.category == TEMPLATE_ERROR


def _weights_reference(offsets, spans):
    """The definition: a token takes the weight of the span its [start, stop) range overlaps."""
    return [next((w for s, e, w in spans if start < e and stop > s), 0.0) for start, stop in offsets]


@settings(max_examples=200, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 60), min_size=1, max_size=30),
    marks=st.lists(st.integers(0, 60), max_size=8),
    data=st.data(),
)
def test_weights_from_spans_matches_the_definition(cuts, marks, data):
    cuts = sorted(set(cuts) | {0})
    offsets = list(zip(cuts, cuts[1:])) + [(cuts[-1], cuts[-1])]  # contiguous tokens, one zero-width
    points = sorted(set(marks))
    spans = [(a, b, data.draw(st.sampled_from([0.5, 1.0, 2.0]))) for a, b in zip(points[::2], points[1::2]) if b > a]
    assert weights_from_spans(offsets, spans) == _weights_reference(offsets, spans)


@settings(max_examples=300, deadline=None)
@given(a=st.text("ab", max_size=40), text=st.text("ab", max_size=40), data=st.data())
def test_common_suffix_matches_the_definition(a, text, data):
    end = data.draw(st.integers(0, len(text)))
    n = next(k for k in range(min(len(a), end), -1, -1) if a[len(a) - k :] == text[end - k : end])
    assert _common_suffix(a, text, end) == n
