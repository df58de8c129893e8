"""Chat templates of today's MoE families masked exactly: GLM-4.5 (turns closed by the next role tag),
Kimi-K2, DeepSeek-V3.1 (thinking / non-thinking turns, history without reasoning), MiniMax-M2
(reasoning kept) and Qwen3.5 / Qwen3.6 (thinking on, history without reasoning, XML tool calls). Each
template below is written here after the structure of the family's released chat_template (role tags,
reasoning and tool-call layout), except Qwen3.5's and Qwen3.6's, which are the release files
themselves (tests/cpu/fixtures/chat_templates/); the role tags are added special tokens on a copy of
the demo tokenizer. For each: the token ids equal `apply_chat_template` (for GLM, plus the
stop token `<|user|>` appended after a trained last turn, which its template leaves open), and the
loss weights lie on every token of every trained assistant turn (its closing token included) and on
nothing of system/user/tool turns, under all_assistant, last_assistant and per-message weights."""

from __future__ import annotations

import hashlib
from itertools import groupby
from pathlib import Path

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from moe_sft.data.chat import tokenize_conversation
from moe_sft.data.formats import RowError

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
AGENT = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": "functions.get_weather:0"},
    {"role": "assistant", "content": "It is sunny in Paris.", "reasoning_content": "The tool says sunny."},
    {"role": "user", "content": "Thanks! And tomorrow?"},
    {"role": "assistant", "content": "I cannot forecast.", "reasoning_content": "No forecast tool."},
]

# GLM-4.5/4.6: `[gMASK]<sop>`, role tags and no end-of-turn token; `<|assistant|>` then `\n<think>...</think>`
# (empty for history turns before the last user message and for turns without reasoning), `\n` + content,
# tool calls as `<tool_call>name` + `<arg_key>`/`<arg_value>` pairs; tool results after `<|observation|>`.
GLM45_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools -%}{{ '<|system|>\\n# Tools\\n\\n<tools>\\n' }}"
    "{%- for tool in tools -%}{{ tool | tojson }}{{ '\\n' }}{%- endfor -%}"
    "{{ '</tools>\\n\\nFor each function call, output <tool_call>{function-name}...</tool_call>' }}{%- endif -%}"
    "{%- set ns = namespace(last_user_index=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user_index = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ '<|user|>\\n' + m.content }}"
    "{%- elif m.role == 'assistant' -%}{{ '<|assistant|>' }}"
    "{%- set content = m.content -%}"
    "{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- else -%}{%- set reasoning = '' -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_user_index and reasoning -%}{{ '\\n<think>' + reasoning.strip() + '</think>' }}"
    "{%- else -%}{{ '\\n<think></think>' }}{%- endif -%}"
    "{%- if content.strip() -%}{{ '\\n' + content.strip() }}{%- endif -%}"
    "{%- for tc in m.tool_calls or [] -%}{%- set f = tc.function -%}{{ '\\n<tool_call>' + f.name }}"
    "{%- for k, v in f.arguments.items() -%}"
    "{{ '\\n<arg_key>' + k + '</arg_key>\\n<arg_value>' + (v if v is string else v | tojson) + '</arg_value>' }}"
    "{%- endfor -%}{{ '\\n</tool_call>' }}{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|observation|>' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- elif m.role == 'system' -%}{{ '<|system|>\\n' + m.content }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)
# GLM-4.7: the same, but a turn without reasoning (and every history turn) is written with only `</think>`,
# reasoning as `<think>...</think>` without newlines, and the generation prompt opens `<think>`.
GLM47_TEMPLATE = (
    GLM45_TEMPLATE.replace(
        "'\\n<think>' + reasoning.strip() + '</think>'", "'<think>' + reasoning.strip() + '</think>'"
    )
    .replace("{{ '\\n<think></think>' }}", "{{ '</think>' }}")
    .replace("{{ '\\n' + content.strip() }}", "{{ content.strip() }}")
    .replace(
        "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}",
        "{%- if add_generation_prompt -%}{{ '<|assistant|><think>' }}",
    )
)
GLM_TOKENS = [
    "[gMASK]",
    "<sop>",
    "<|endoftext|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
]
GLM_CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"

# Kimi-K2: `<|im_system|>system<|im_middle|>...<|im_end|>`, a default system turn, tools declared in a
# `tool_declare` turn, tool calls in a `<|tool_calls_section_begin|>` block, tool results as `## Return of`.
KIMI_K2_TEMPLATE = (
    "{%- if tools -%}{{ '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m.role != 'system' -%}"
    "{{ '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' }}"
    "{%- endif -%}"
    "{%- if m.role == 'system' -%}{{ '<|im_system|>system<|im_middle|>' }}"
    "{%- elif m.role == 'user' -%}{{ '<|im_user|>user<|im_middle|>' }}"
    "{%- elif m.role == 'assistant' -%}{{ '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- else -%}{{ '<|im_system|>tool<|im_middle|>' }}{%- endif -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}{{ m.content + '<|tool_calls_section_begin|>' }}"
    "{%- for tc in m.tool_calls -%}"
    "{{ '<|tool_call_begin|>' + tc.id + '<|tool_call_argument_begin|>' + (tc.function.arguments | tojson) }}"
    "{{ '<|tool_call_end|>' }}{%- endfor -%}{{ '<|tool_calls_section_end|>' }}"
    "{%- elif m.role == 'tool' -%}{{ '## Return of ' + m.tool_call_id + '\\n' + m.content }}"
    "{%- else -%}{{ m.content }}{%- endif -%}"
    "{{ '<|im_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_assistant|>assistant<|im_middle|>' }}{%- endif -%}"
)
KIMI_TOKENS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
KIMI_CALL = (
    '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
    "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
)

# DeepSeek-V3.1: bos + system prompt, `<｜User｜>`, `<｜Assistant｜>` + `</think>` (non-thinking) or
# `<think>` (thinking, here kept for the turn after the last user message, as SFT frameworks train V3.1
# thinking data; history turns lose their reasoning as in the released template), `<｜end▁of▁sentence｜>`
# closing every assistant turn; tool calls in `<｜tool▁calls▁begin｜>`, results in `<｜tool▁output▁begin｜>`,
# after which the assistant continues without a header.
DEEPSEEK_V31_TEMPLATE = (
    "{%- set ns = namespace(system_prompt='', is_last_user=false, is_tool=false, last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.system_prompt = m.content -%}{%- endif -%}"
    "{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{{ bos_token + ns.system_prompt }}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{%- set ns.is_last_user = true -%}{%- set ns.is_tool = false -%}"
    "{{ '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{%- if ns.is_last_user -%}{{ '<｜Assistant｜></think>' }}{%- endif -%}"
    "{%- set ns.is_last_user = false -%}{%- set ns.is_tool = false -%}{{ m.content + '<｜tool▁calls▁begin｜>' }}"
    "{%- for tc in m.tool_calls -%}"
    "{{ '<｜tool▁call▁begin｜>' + tc.function.name + '<｜tool▁sep｜>' + (tc.function.arguments | tojson) }}"
    "{{ '<｜tool▁call▁end｜>' }}{%- endfor -%}{{ '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>', 1)[1] -%}{%- endif -%}"
    "{%- if ns.is_last_user -%}{{ '<｜Assistant｜>' }}"
    "{%- if reasoning and loop.index0 > ns.last_user -%}{{ '<think>' + reasoning + '</think>' }}"
    "{%- else -%}{{ '</think>' }}{%- endif -%}{%- endif -%}"
    "{%- set ns.is_last_user = false -%}{%- set ns.is_tool = false -%}{{ content + '<｜end▁of▁sentence｜>' }}"
    "{%- elif m.role == 'tool' -%}{%- set ns.is_last_user = false -%}{%- set ns.is_tool = true -%}"
    "{{ '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool -%}{{ '<｜Assistant｜>' }}"
    "{%- if thinking is defined and thinking -%}{{ '<think>' }}{%- else -%}{{ '</think>' }}{%- endif -%}{%- endif -%}"
)
DEEPSEEK_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]
EOS_DS = "<｜end▁of▁sentence｜>"

# MiniMax-M2: `]~!b[]~b]system\n...[e~[\n`, `]~b]user\n`, `]~b]ai\n`, `]~b]tool\n<response>...`, every turn
# closed by `[e~[` + `\n`; reasoning kept as `<think>\n...\n</think>\n\n`; tool calls as `<minimax:tool_call>`
# with `<invoke>`/`<parameter>`; the generation prompt opens a think block.
MINIMAX_M2_TEMPLATE = (
    "{{ ']~!b[]~b]system\\n' }}"
    "{%- if messages[0].role == 'system' -%}{{ messages[0].content }}{%- else -%}{{ 'You are MiniMax.' }}{%- endif -%}"
    "{%- if tools -%}{{ '\\n\\n# Tools\\n<tools>\\n' }}{%- for tool in tools -%}"
    "{{ '<tool>' + (tool.function | tojson) + '</tool>\\n' }}{%- endfor -%}{{ '</tools>' }}{%- endif -%}"
    "{{ '[e~[\\n' }}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ ']~b]user\\n' + m.content + '[e~[\\n' }}"
    "{%- elif m.role == 'assistant' -%}{{ ']~b]ai\\n' }}"
    "{%- set content = m.content -%}"
    "{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].strip('\\n').split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].strip('\\n') -%}"
    "{%- else -%}{%- set reasoning = '' -%}{%- endif -%}"
    "{%- if reasoning -%}{{ '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ content }}"
    "{%- if m.tool_calls -%}{{ '\\n<minimax:tool_call>\\n' }}{%- for tc in m.tool_calls -%}"
    "{{ '<invoke name=\"' + tc.function.name + '\">\\n' }}{%- for k, v in tc.function.arguments.items() -%}"
    "{{ '<parameter name=\"' + k + '\">' + v + '</parameter>\\n' }}{%- endfor -%}{{ '</invoke>\\n' }}"
    "{%- endfor -%}{{ '</minimax:tool_call>' }}{%- endif -%}"
    "{{ '[e~[\\n' }}"
    "{%- elif m.role == 'tool' -%}{{ ']~b]tool\\n<response>' + m.content + '</response>[e~[\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ ']~b]ai\\n<think>\\n' }}{%- endif -%}"
)
MINIMAX_TOKENS = ["]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"]

# gpt-oss (harmony): a system header, the system message as the developer's instructions (plus the
# tools), `<|start|>ROLE<|message|>...<|end|>` per message. An assistant message is one or more
# segments under `<|start|>assistant`: history turns only their final answer closed by `<|end|>`; the
# last turn its reasoning (analysis channel, `<|end|>`) and its answer closed by `<|return|>`; a tool
# call as `to=functions.NAME` on the commentary channel closed by `<|call|>`, after its reasoning
# unless a later assistant message gives a final answer; a tool-call message with both content and
# reasoning is refused, as the release's template does. The generation prompt is `<|start|>assistant`.
HARMONY_TEMPLATE = (
    "{{ '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n"
    "Reasoning: medium\\n\\n# Valid channels: analysis, commentary, final.' }}"
    "{%- if tools -%}{{ '\\nCalls to these tools must go to the commentary channel: functions.' }}{%- endif -%}"
    "{{ '<|end|>' }}"
    "{%- if messages[0].role == 'system' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- set instructions = messages[0].content -%}"
    "{%- else -%}{%- set loop_messages = messages -%}{%- set instructions = '' -%}{%- endif -%}"
    "{%- if instructions or tools -%}{{ '<|start|>developer<|message|>' }}"
    "{%- if instructions -%}{{ '# Instructions\\n\\n' + instructions }}{%- endif -%}"
    "{%- if tools -%}{{ '\\n\\n# Tools\\n\\nnamespace functions {\\n' }}{%- for t in tools -%}"
    "{{ '// ' + t.function.description + '\\ntype ' + t.function.name + ' = (_: ' + (t.function.parameters | tojson)"
    " + ') => any;\\n' }}{%- endfor -%}{{ '} // namespace functions' }}{%- endif -%}"
    "{{ '<|end|>' }}{%- endif -%}"
    "{%- set ns = namespace(tool='') -%}"
    "{%- for m in loop_messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.tool_calls -%}"
    "{%- if m.content and m.thinking -%}{{ raise_exception('Cannot pass both content and thinking') }}{%- endif -%}"
    "{%- set finals = loop_messages[loop.index:] | selectattr('role', 'equalto', 'assistant')"
    " | rejectattr('tool_calls') | list -%}"
    "{%- if m.thinking and not finals -%}"
    "{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{%- endif -%}"
    "{%- set call = m.tool_calls[0].function -%}"
    "{{ '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>'"
    " + (call.arguments | tojson) + '<|call|>' }}{%- set ns.tool = call.name -%}"
    "{%- elif loop.last and not add_generation_prompt -%}"
    "{%- if m.thinking -%}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}"
    "{%- endif -%}{{ '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' }}"
    "{%- else -%}{{ '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|start|>functions.' + ns.tool + ' to=assistant<|channel|>commentary<|message|>' + (m.content | tojson)"
    " + '<|end|>' }}"
    "{%- elif m.role == 'user' -%}{{ '<|start|>user<|message|>' + m.content + '<|end|>' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}"
)
HARMONY_TOKENS = ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
HARMONY_AGENT = [  # reasoning under `thinking`, gpt-oss's field
    {key: value for key, value in m.items() if key != "reasoning_content"}
    | ({"thinking": m["reasoning_content"]} if "reasoning_content" in m else {})
    for m in AGENT
]
HARMONY_CALL = ' to=functions.{}<|channel|>commentary json<|message|>{{"city": "{}"}}<|call|>'


def _call(city: str) -> dict:
    return {**CALL, "function": {"name": "get_weather", "arguments": {"city": city}}}


# An agent's step before any final answer: every tool call keeps its reasoning.
HARMONY_CALLS = [
    AGENT[0],
    AGENT[1],
    {"role": "assistant", "content": "", "thinking": "I should call the tool.", "tool_calls": [_call("Paris")]},
    AGENT[3],
    {"role": "assistant", "content": "", "thinking": "Lyon too.", "tool_calls": [_call("Lyon")]},
    {"role": "tool", "content": '{"sky": "rainy"}'},
    {"role": "assistant", "content": "", "thinking": "And Nice.", "tool_calls": [_call("Nice")]},
]
HARMONY_CHAT = [
    {"role": "system", "content": "Think step by step."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "thinking": "add"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6"},
    {"role": "user", "content": "4+4?"},
    {"role": "assistant", "content": "8", "thinking": "once more"},
]
FINAL = "<|channel|>final<|message|>{}"
ANALYSIS = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant"

# An answer right after a tool result (issue 42): the last turn renders its reasoning and its answer as
# two segments, while the earlier call's reasoning is dropped once that final answer exists, so the
# prefix render (which keeps it) is not a prefix of the full text.
HARMONY_TOOL_ANSWER = [
    HARMONY_CHAT[0],
    HARMONY_CHAT[1],
    HARMONY_CHAT[2],
    AGENT[1],
    {"role": "assistant", "content": "", "thinking": "I should call the tool.", "tool_calls": [CALL]},
    AGENT[3],
    {"role": "assistant", "content": "It is sunny in Paris.", "thinking": "The tool says sunny."},
]

R_CHAT = [
    {"role": "system", "content": "Think step by step."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>add</think>4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6"},
    {"role": "user", "content": "4+4?"},
    {"role": "assistant", "content": "<think>once more</think>8"},
]
DS_TOOL_CHAT = [
    AGENT[0],
    AGENT[1],
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    AGENT[3],
    {"role": "assistant", "content": "It is sunny in Paris."},
    AGENT[5],
    {"role": "assistant", "content": "<think>No forecast tool.</think>I cannot forecast."},
]

# Nemotron-3-Nano style (issue 42): ChatML turns; a turn without reasoning, and every turn before the last
# user message (its reasoning truncated), is written with an empty `<think></think>`, while the generation
# prompt opens `<think>\n` (thinking on by default): the render of messages[:i] + generation prompt is not
# the start of the full text even for a single turn, and the full prompt never appears before a turn
# without reasoning. Tool calls as `<tool_call>\n<function=NAME>` with `<parameter=K>` blocks; tool results
# in a user turn.
NEMOTRON3_TEMPLATE = (
    "{%- set enable_thinking = enable_thinking if enable_thinking is defined else true -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{ '<|im_start|>system\\n' + m.content }}"
    "{%- if tools -%}{{ '\\n\\n# Tools\\n<tools>' }}{%- for t in tools -%}{{ '\\n' + (t.function | tojson) }}"
    "{%- endfor -%}{{ '\\n</tools>' }}{%- endif -%}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.reasoning_content and loop.index0 > ns.last_user -%}"
    "{%- set think = '<think>\\n' + m.reasoning_content + '\\n</think>\\n' -%}"
    "{%- else -%}{%- set think = '<think></think>' -%}{%- endif -%}"
    "{{ '<|im_start|>assistant\\n' + think + m.content }}{%- if m.tool_calls -%}{{ '\\n' }}{%- endif -%}"
    "{%- for tc in m.tool_calls or [] -%}{{ '<tool_call>\\n<function=' + tc.function.name + '>\\n' }}"
    "{%- for k, v in tc.function.arguments.items() -%}{{ '<parameter=' + k + '>\\n' + v + '\\n</parameter>\\n' }}"
    "{%- endfor -%}{{ '</function>\\n</tool_call>\\n' }}{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{%- if enable_thinking -%}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- else -%}{{ '<|im_start|>assistant\\n<think></think>' }}{%- endif -%}{%- endif -%}"
)
NEMOTRON_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
NEMOTRON_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
)
NEMOTRON_CHAT = [
    HARMONY_CHAT[0],
    HARMONY_CHAT[1],
    {"role": "assistant", "content": "4", "reasoning_content": "add"},
    *HARMONY_CHAT[3:6],
    {"role": "assistant", "content": "8", "reasoning_content": "once more"},
]

# Two tool calls, then the answer: the calls' reasoning is dropped from the full text (a final answer
# follows), and locating a call's turn must not make the template refuse the row (content + thinking).
HARMONY_TWO_CALLS = [
    *HARMONY_CALLS[:5],
    HARMONY_CALLS[5],
    {"role": "assistant", "content": "Sunny, then rainy.", "thinking": "Both known."},
]

# Qwen3.5 / Qwen3.6 (qwen3_5_moe, Qwen3-Next's successors): the release templates themselves, not a
# pattern written here. tests/cpu/fixtures/chat_templates/qwen3_5.jinja and qwen3_6.jinja are Qwen's
# chat_template.jinja (Apache-2.0; provenance in docs/data.md). ChatML turns closed by `<|im_end|>`; the
# generation prompt opens `<think>\n` (thinking on by default); turns after the last user query are
# written `<think>\nREASONING\n</think>\n\n` + content (an empty block when there is no reasoning), earlier
# turns with their reasoning dropped; tool calls as `<tool_call>\n<function=NAME>` with `<parameter=K>`
# blocks; tool results as `<tool_response>` blocks in one user turn. Qwen3.6 adds `preserve_thinking`
# (unset here, as in every render of the pipeline) and writes non-string arguments as JSON.
CHAT_TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
QWEN35_TEMPLATE = (CHAT_TEMPLATES / "qwen3_5.jinja").read_text(encoding="utf-8")
QWEN36_TEMPLATE = (CHAT_TEMPLATES / "qwen3_6.jinja").read_text(encoding="utf-8")
QWEN35_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
QWEN35_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
# Earlier turns lose their reasoning (a history turn is trained from right after `<|im_start|>assistant\n`);
# the last turn's `<think>\n` is the generation prompt's, so its reasoning is trained from its first token.
QWEN35_AGENT_TRAINED = [
    f"{QWEN35_CALL}<|im_end|>",
    "It is sunny in Paris.<|im_end|>",
    "No forecast tool.\n</think>\n\nI cannot forecast.<|im_end|>",
]

# name: (added tokens, template, eos, bos, messages, tools, the trained text of each assistant turn).
FAMILIES = {
    "glm45_agent": (
        GLM_TOKENS,
        GLM45_TEMPLATE,
        "<|endoftext|>",
        None,
        AGENT,
        [WEATHER_TOOL],
        [
            # History turns lose their reasoning; each turn ends with the role tag that hands over.
            f"\n<think></think>\n{GLM_CALL}<|observation|>",
            "\n<think></think>\nIt is sunny in Paris.<|user|>",
            # The last turn: the template writes nothing after it; its stop token is appended.
            "\n<think>No forecast tool.</think>\nI cannot forecast.<|user|>",
        ],
    ),
    "glm45_chat": (
        GLM_TOKENS,
        GLM45_TEMPLATE,
        "<|endoftext|>",
        None,
        R_CHAT,
        None,
        ["\n<think></think>\n4<|user|>", "\n<think></think>\n6<|user|>", "\n<think>once more</think>\n8<|user|>"],
    ),
    # The prompt's `<think>` is never in the text; a turn without reasoning is trained from its `</think>`.
    "glm47_chat": (
        GLM_TOKENS,
        GLM47_TEMPLATE,
        "<|endoftext|>",
        None,
        R_CHAT,
        None,
        ["</think>4<|user|>", "</think>6<|user|>", "once more</think>8<|user|>"],
    ),
    "kimi_k2_agent": (
        KIMI_TOKENS,
        KIMI_K2_TEMPLATE,
        "[EOS]",
        "[BOS]",
        AGENT,
        [WEATHER_TOOL],
        [KIMI_CALL, "It is sunny in Paris.<|im_end|>", "I cannot forecast.<|im_end|>"],
    ),
    "kimi_k2_chat": (
        KIMI_TOKENS,
        KIMI_K2_TEMPLATE,
        "[EOS]",
        "[BOS]",
        R_CHAT[1:],
        None,
        ["<think>add</think>4<|im_end|>", "6<|im_end|>", "<think>once more</think>8<|im_end|>"],
    ),
    "deepseek_v31_chat": (
        DEEPSEEK_TOKENS,
        DEEPSEEK_V31_TEMPLATE,
        EOS_DS,
        "<｜begin▁of▁sentence｜>",
        R_CHAT,
        None,
        # Non-thinking and history turns: `</think>` is the generation prompt's; the thinking turn is
        # trained from `<think>` (its header `<｜Assistant｜>` is not).
        [f"4{EOS_DS}", f"6{EOS_DS}", f"<think>once more</think>8{EOS_DS}"],
    ),
    "deepseek_v31_agent": (
        DEEPSEEK_TOKENS,
        DEEPSEEK_V31_TEMPLATE,
        EOS_DS,
        "<｜begin▁of▁sentence｜>",
        DS_TOOL_CHAT,
        None,
        [
            f'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{{"city": "Paris"}}<｜tool▁call▁end｜><｜tool▁calls▁end｜>{EOS_DS}',
            f"It is sunny in Paris.{EOS_DS}",
            f"<think>No forecast tool.</think>I cannot forecast.{EOS_DS}",
        ],
    ),
    "minimax_m2_agent": (
        MINIMAX_TOKENS,
        MINIMAX_M2_TEMPLATE,
        "[e~[",
        None,
        AGENT,
        [WEATHER_TOOL],
        [
            # The generation prompt opens `<think>\n`: turns with reasoning are trained after it.
            'I should call the tool.\n</think>\n\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
            '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>[e~[',
            "The tool says sunny.\n</think>\n\nIt is sunny in Paris.[e~[",
            "No forecast tool.\n</think>\n\nI cannot forecast.[e~[",
        ],
    ),
    "minimax_m2_chat": (
        MINIMAX_TOKENS,
        MINIMAX_M2_TEMPLATE,
        "[e~[",
        None,
        R_CHAT,
        None,
        ["add\n</think>\n\n4[e~[", "6[e~[", "once more\n</think>\n\n8[e~["],
    ),
    "gpt_oss_agent": (
        HARMONY_TOKENS,
        HARMONY_TEMPLATE,
        "<|return|>",
        None,
        HARMONY_AGENT,
        [WEATHER_TOOL],
        [
            # A later final answer drops the call's reasoning; history answers end with `<|end|>`;
            # the last turn is its reasoning and its answer, through `<|return|>`.
            HARMONY_CALL.format("get_weather", "Paris"),
            FINAL.format("It is sunny in Paris.<|end|>"),
            ANALYSIS.format("No forecast tool.") + FINAL.format("I cannot forecast.<|return|>"),
        ],
    ),
    "gpt_oss_calls": (
        HARMONY_TOKENS,
        HARMONY_TEMPLATE,
        "<|return|>",
        None,
        HARMONY_CALLS,
        [WEATHER_TOOL],
        [
            ANALYSIS.format("I should call the tool.") + HARMONY_CALL.format("get_weather", "Paris"),
            ANALYSIS.format("Lyon too.") + HARMONY_CALL.format("get_weather", "Lyon"),
            ANALYSIS.format("And Nice.") + HARMONY_CALL.format("get_weather", "Nice"),
        ],
    ),
    "gpt_oss_tool_answer": (
        HARMONY_TOKENS,
        HARMONY_TEMPLATE,
        "<|return|>",
        None,
        HARMONY_TOOL_ANSWER,
        [WEATHER_TOOL],
        [
            FINAL.format("4<|end|>"),
            HARMONY_CALL.format("get_weather", "Paris"),
            # Every segment the model writes after the tool result: its reasoning and its answer.
            ANALYSIS.format("The tool says sunny.") + FINAL.format("It is sunny in Paris.<|return|>"),
        ],
    ),
    "gpt_oss_two_calls": (
        HARMONY_TOKENS,
        HARMONY_TEMPLATE,
        "<|return|>",
        None,
        HARMONY_TWO_CALLS,
        [WEATHER_TOOL],
        [
            HARMONY_CALL.format("get_weather", "Paris"),
            HARMONY_CALL.format("get_weather", "Lyon"),
            ANALYSIS.format("Both known.") + FINAL.format("Sunny, then rainy.<|return|>"),
        ],
    ),
    "gpt_oss_chat": (
        HARMONY_TOKENS,
        HARMONY_TEMPLATE,
        "<|return|>",
        None,
        HARMONY_CHAT,
        None,
        [
            FINAL.format("4<|end|>"),
            FINAL.format("6<|end|>"),
            ANALYSIS.format("once more") + FINAL.format("8<|return|>"),
        ],
    ),
    # The prompt's `<think>` is the header; a turn without reasoning (or truncated) is trained from `</think>`.
    "nemotron3_agent": (
        NEMOTRON_TOKENS,
        NEMOTRON3_TEMPLATE,
        "<|im_end|>",
        None,
        AGENT,
        [WEATHER_TOOL],
        [
            f"</think>\n{NEMOTRON_CALL}<|im_end|>",
            "</think>It is sunny in Paris.<|im_end|>",
            "No forecast tool.\n</think>\nI cannot forecast.<|im_end|>",
        ],
    ),
    "nemotron3_chat": (
        NEMOTRON_TOKENS,
        NEMOTRON3_TEMPLATE,
        "<|im_end|>",
        None,
        NEMOTRON_CHAT,
        None,
        ["</think>4<|im_end|>", "</think>6<|im_end|>", "once more\n</think>\n8<|im_end|>"],
    ),
    "qwen3_5_agent": (
        QWEN35_TOKENS,
        QWEN35_TEMPLATE,
        "<|im_end|>",
        None,
        AGENT,
        [WEATHER_TOOL],
        QWEN35_AGENT_TRAINED,
    ),
    "qwen3_6_agent": (
        QWEN35_TOKENS,
        QWEN36_TEMPLATE,
        "<|im_end|>",
        None,
        AGENT,
        [WEATHER_TOOL],
        QWEN35_AGENT_TRAINED,
    ),
    # Reasoning written inline in the content: the template splits it off, and drops it from history.
    "qwen3_5_chat": (
        QWEN35_TOKENS,
        QWEN35_TEMPLATE,
        "<|im_end|>",
        None,
        R_CHAT,
        None,
        ["4<|im_end|>", "6<|im_end|>", "once more\n</think>\n\n8<|im_end|>"],
    ),
}
# Families whose template leaves the last turn open: the stop token appended after it (close_last_turn).
LAST_TURN_STOP = {"glm45_agent": "<|user|>", "glm45_chat": "<|user|>", "glm47_chat": "<|user|>"}
MODES = {
    "all_assistant": (None, [1.0, 1.0, 1.0]),
    "last_assistant": (None, [0.0, 0.0, 1.0]),
    "per_message_weights": ([0.5, 0.0, 2.0], [0.5, 0.0, 2.0]),
}


def _tokenizer(name: str):
    tokens, template, eos, bos, *_ = FAMILIES[name]
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    tok.chat_template = template
    tok.add_tokens(tokens, special_tokens=True)
    tok.eos_token = eos
    if bos:
        tok.bos_token = bos
    return tok


def masked_runs(tok, doc) -> list[tuple[str, float]]:
    runs, pos = [], 0
    for weight, group in groupby(doc.loss_weights):
        n = len(list(group))
        if weight > 0:
            runs.append((tok.decode(doc.input_ids[pos : pos + n], skip_special_tokens=False), weight))
        pos += n
    return runs


def _expected_weights(tok, text: str, messages, trained: list[str], weights: list[float]) -> list[float]:
    """Independent oracle: each turn's expected trained text, searched after the previous message's text,
    gives a character span; a token takes the weight of the span it lies in, and none straddles one."""
    spans, cursor, turns = [], 0, iter(zip(trained, weights))
    for m in messages:
        if m["role"] == "assistant":
            want, w = next(turns)
            start = text.find(want, cursor)
            assert start >= cursor, (want, text[cursor:])
            cursor = start + len(want)
            spans.append((start, cursor, w))
        elif m.get("content") and (pos := text.find(m["content"], cursor)) >= 0:
            cursor = pos + len(m["content"])
    out = []
    for a, b in tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]:
        inside = [w for s, e, w in spans if s <= a and b <= e]
        assert inside or not any(a < e and b > s for s, e, _ in spans), f"token {text[a:b]!r} straddles a span"
        out.append(inside[0] if inside else 0.0)
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_templates_train_exactly_the_assistant_turns(name, mode):
    _, _, _, _, messages, tools, trained = FAMILIES[name]
    tok = _tokenizer(name)
    message_weights, expected = MODES[mode]
    rows = [dict(m) for m in messages]
    if message_weights:
        for m, w in zip([m for m in rows if m["role"] == "assistant"], message_weights):
            m["weight"] = w
    loss_on = "last_assistant" if mode == "last_assistant" else "all_assistant"
    doc = tokenize_conversation(tok, rows, 4096, tools=tools, loss_on=loss_on)
    # The ids are exactly the template's own rendering and tokenization (+ GLM's last stop token).
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    stop = LAST_TURN_STOP.get(name, "")
    text += stop
    assert list(doc.input_ids) == list(ids) + ([tok.convert_tokens_to_ids(stop)] if stop else [])
    assert list(doc.loss_weights) == _expected_weights(tok, text, messages, trained, expected)
    assert masked_runs(tok, doc) == [(t, w) for t, w in zip(trained, expected) if w > 0]
    # Nothing of system, user or tool turns, nor the tools list, is trained.
    trained_text = "".join(t for t, _ in masked_runs(tok, doc))
    for m in messages:
        if m["role"] != "assistant" and m.get("content"):
            assert m["content"] not in trained_text, m
    assert "Weather of a city" not in trained_text


def test_gpt_oss_reasoning_of_an_answer_after_a_tool_result_is_trained():
    """The conversation of issue 42: system, user, assistant (reasoning + tool call), tool, assistant
    (reasoning + answer). The last turn is rendered as an analysis segment and a final segment; both
    are the model's output and both are trained, with the turn's weight."""
    tok = _tokenizer("gpt_oss_agent")
    messages = HARMONY_AGENT[:5]
    last = ANALYSIS.format("The tool says sunny.") + FINAL.format("It is sunny in Paris.<|return|>")
    call = HARMONY_CALL.format("get_weather", "Paris")
    for weights in ([1.0, 1.0], [0.5, 2.0], [0.0, 3.0]):
        rows = [dict(m) for m in messages]
        rows[2]["weight"], rows[4]["weight"] = weights
        doc = tokenize_conversation(tok, rows, 4096, tools=[WEATHER_TOOL])
        ids = tok.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=True, return_dict=False)
        text = tok.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False)
        assert text.endswith(last) and "I should call the tool." not in text  # the call's reasoning is dropped
        assert list(doc.input_ids) == list(ids)
        assert list(doc.loss_weights) == _expected_weights(tok, text, messages, [call, last], weights)
        assert masked_runs(tok, doc) == [(t, w) for t, w in zip([call, last], weights) if w > 0]
    # With a user turn after it, the answer renders without its reasoning, and the new last turn with it.
    more = [
        *messages,
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "Welcome.", "thinking": "Polite."},
    ]
    doc = tokenize_conversation(tok, more, 4096, tools=[WEATHER_TOOL])
    assert [t for t, _ in masked_runs(tok, doc)] == [
        call,
        FINAL.format("It is sunny in Paris.<|end|>"),
        ANALYSIS.format("Polite.") + FINAL.format("Welcome.<|return|>"),
    ]


def test_templates_that_open_the_turn_differently_from_the_prompt():
    """Nemotron-3 style: the generation prompt `<|im_start|>assistant\n<think>\n` is never a prefix of the
    full text before a turn without reasoning (`<think></think>` there), for one turn as for many."""
    tok = _tokenizer("nemotron3_chat")
    single = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    prompt = tok.apply_chat_template(single[:1], tokenize=False, add_generation_prompt=True)
    assert not tok.apply_chat_template(single, tokenize=False).startswith(prompt)
    for rows, trained in (
        (single, ["</think>4<|im_end|>"]),
        ([single[0], {**single[1], "reasoning_content": "add"}], ["add\n</think>\n4<|im_end|>"]),
    ):
        doc = tokenize_conversation(tok, rows, 4096)
        assert list(doc.input_ids) == list(tok.apply_chat_template(rows, tokenize=True, return_dict=False))
        assert masked_runs(tok, doc) == [(t, 1.0) for t in trained]
    # A template that writes the turn's header as plain text the prompt does not have (here the message
    # count) is refused, naming the way out.
    odd = _tokenizer("nemotron3_chat")
    odd.chat_template = NEMOTRON3_TEMPLATE.replace(
        "'<|im_start|>assistant\\n' + think", "'<|im_start|>assistant ' + (messages | length | string) + '\\n' + think"
    )
    assert "assistant 2\n" in odd.apply_chat_template(single, tokenize=False)
    with pytest.raises(
        RowError, match=r"^n\.jsonl:3: .*renders messages\[:1\] \+ generation prompt .*data\.chat_template"
    ):
        tokenize_conversation(odd, single, 4096, source="n.jsonl:3")


# Turns without reasoning: (family, messages, trained text per turn with empty_think=train, with =mask).
EMPTY_THINK_CASES = {
    # GLM writes `\n<think></think>\n` into every turn without reasoning and every history turn.
    "glm45_chat": (
        R_CHAT,
        ["\n<think></think>\n4<|user|>", "\n<think></think>\n6<|user|>", "\n<think>once more</think>\n8<|user|>"],
        ["\n", "4<|user|>", "\n", "6<|user|>", "\n<think>once more</think>\n8<|user|>"],
    ),
    # GLM-4.7 writes only `</think>` there: the turn's first tokens, masked like a whole empty block.
    "glm47_chat": (
        R_CHAT,
        ["</think>4<|user|>", "</think>6<|user|>", "once more</think>8<|user|>"],
        ["4<|user|>", "6<|user|>", "once more</think>8<|user|>"],
    ),
    # DeepSeek-V3.1's non-thinking turns carry only `</think>`, which is the generation prompt's: never
    # trained, so nothing changes; a reasoning block that is not empty is trained in both modes.
    "deepseek_v31_chat": (
        R_CHAT,
        [f"4{EOS_DS}", f"6{EOS_DS}", f"<think>once more</think>8{EOS_DS}"],
        [f"4{EOS_DS}", f"6{EOS_DS}", f"<think>once more</think>8{EOS_DS}"],
    ),
    # Nemotron-3: the block opens in the header (the prompt's `<think>`); its `</think>` is the turn's.
    "nemotron3_chat": (
        NEMOTRON_CHAT,
        ["</think>4<|im_end|>", "</think>6<|im_end|>", "once more\n</think>\n8<|im_end|>"],
        ["4<|im_end|>", "6<|im_end|>", "once more\n</think>\n8<|im_end|>"],
    ),
    # Qwen3.5 / 3.6: a last turn without reasoning is written `<think>\n\n</think>\n\n`; the prompt's `<think>\n`
    # is not trained, the rest of the empty block is (default) or is masked with it.
    "qwen3_5_chat": (
        [*R_CHAT[:-1], {"role": "assistant", "content": "8"}],
        ["4<|im_end|>", "6<|im_end|>", "\n</think>\n\n8<|im_end|>"],
        ["4<|im_end|>", "6<|im_end|>", "8<|im_end|>"],
    ),
}


@pytest.mark.parametrize("name", list(EMPTY_THINK_CASES))
def test_empty_think_blocks_are_trained_or_masked(name):
    messages, trained, masked = EMPTY_THINK_CASES[name]
    tok = _tokenizer(name)
    default = tokenize_conversation(tok, messages, 4096)
    train = tokenize_conversation(tok, messages, 4096, empty_think="train")
    mask = tokenize_conversation(tok, messages, 4096, empty_think="mask")
    assert [t for t, _ in masked_runs(tok, default)] == trained
    assert (list(train.input_ids), list(train.loss_weights)) == (list(default.input_ids), list(default.loss_weights))
    # Masking changes weights only: the model still reads the block.
    assert list(mask.input_ids) == list(default.input_ids)
    assert [t for t, _ in masked_runs(tok, mask)] == masked
    # Per-message weights stay with their turn.
    weighted = [dict(m) for m in messages]
    for m, w in zip([m for m in weighted if m["role"] == "assistant"], (0.5, 0.0, 2.0)):
        m["weight"] = w
    runs = masked_runs(tok, tokenize_conversation(tok, weighted, 4096, empty_think="mask"))
    assert {w for _, w in runs} <= {0.5, 2.0} and runs[-1] == (masked[-1], 2.0)
    with pytest.raises(ValueError, match=r"empty_think='skip' is not supported; use one of train, mask"):
        tokenize_conversation(tok, messages, 4096, empty_think="skip")


def test_glm_turns_end_at_the_next_role_tag():
    tok = _tokenizer("glm45_agent")
    text = tok.apply_chat_template(AGENT, tools=[WEATHER_TOOL], tokenize=False)
    # The template closes no turn: the next role tag follows the assistant text directly.
    assert "</tool_call><|observation|>" in text and "Paris.<|user|>" in text and text.endswith("I cannot forecast.")
    # Two assistant turns in a row, and a system message after a turn: no handover tag is trained there.
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "assistant", "content": "How can I help?"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye."},
    ]
    doc = tokenize_conversation(tok, messages, 4096)
    assert [t for t, _ in masked_runs(tok, doc)] == [
        "\n<think></think>\nHello.",
        "\n<think></think>\nHow can I help?",
        "\n<think></think>\nBye.<|user|>",
    ]
    # Reasoning written inline in the content gives the same tokens and weights as reasoning_content.
    inline = [dict(m) for m in AGENT]
    for m in inline:
        if m["role"] == "assistant":
            m["content"] = f"<think>{m.pop('reasoning_content')}</think>{m['content']}"
    a = tokenize_conversation(tok, AGENT, 4096, tools=[WEATHER_TOOL])
    b = tokenize_conversation(tok, inline, 4096, tools=[WEATHER_TOOL])
    assert (list(a.input_ids), list(a.loss_weights)) == (list(b.input_ids), list(b.loss_weights))


def test_role_tag_templates_need_a_tag_or_an_explicit_end():
    tok = _tokenizer("glm45_chat")
    # An explicit data.end_of_turn must close every turn: GLM has none, so the row is rejected.
    with pytest.raises(RowError, match=r"^g\.jsonl:1: messages\[2\]: .*not closed by any of \['<\|im_end\|>'\]"):
        tokenize_conversation(tok, R_CHAT, 4096, source="g.jsonl:1", end_of_turn="<|im_end|>")
    # A template whose next header is plain text (no added token) gives no closing token: rejected.
    plain = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    plain.chat_template = GLM45_TEMPLATE.replace("<|user|>", "USER:")
    plain.add_tokens([t for t in GLM_TOKENS if t != "<|user|>"], special_tokens=True)
    plain.eos_token = "<|endoftext|>"
    with pytest.raises(RowError, match=r"messages\[2\]: .*nor followed directly by a role tag"):
        tokenize_conversation(plain, R_CHAT, 4096)


# A Gemma-2/3-like layout with an end token the pipeline does not know (`<end_of_msg>`: neither the eos
# nor a known end-of-turn string) and a newline before the next `<start_of_msg>`: not a role-tag
# template, so no closing token is guessed. (Gemma's own `<end_of_turn>` is known: test_chat_gemma.py.)
UNKNOWN_END_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages -%}"
    "{{ '<start_of_msg>' + ('model' if m.role == 'assistant' else m.role) + '\\n' + m.content + '<end_of_msg>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_msg>model\\n' }}{%- endif -%}"
)


def test_unknown_end_tokens_are_not_guessed():
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    tok.chat_template = UNKNOWN_END_TEMPLATE
    tok.add_tokens(["<bos>", "<eos>", "<start_of_msg>", "<end_of_msg>"], special_tokens=True)
    tok.eos_token, tok.bos_token = "<eos>", "<bos>"
    messages = R_CHAT[1:5]
    for rows in (messages, messages[:2]):  # multi-turn, and a single turn ending the text
        with pytest.raises(RowError, match=r"messages\[1\]: .*nor followed directly by a role tag.*data\.end_of_turn"):
            tokenize_conversation(tok, rows, 4096)
    doc = tokenize_conversation(tok, messages, 4096, end_of_turn="<end_of_msg>")
    assert masked_runs(tok, doc) == [("<think>add</think>4<end_of_msg>", 1.0), ("6<end_of_msg>", 1.0)]


def _demo_chatml_prefix_diff():
    """The demo ChatML template without its {% generation %} markers (the prefix-diff path)."""
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    tok.chat_template = tok.chat_template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    return tok


@pytest.mark.parametrize("weight", [1.0, 2.5])
def test_glm_last_turn_is_closed_by_its_stop_token(weight):
    tok = _tokenizer("glm45_chat")
    user, observation = tok.convert_tokens_to_ids(["<|user|>", "<|observation|>"])
    rows = {
        "single_turn": (R_CHAT[1:3], None, user),
        "single_turn_system": (R_CHAT[:3], None, user),
        "multi_turn": (R_CHAT, None, user),
        "agent": (AGENT, [WEATHER_TOOL], user),
        # A last turn that calls a tool hands over to the tool: GLM's stop token there is <|observation|>.
        "tool_call_last": (AGENT[:3], [WEATHER_TOOL], observation),
    }
    for name, (messages, tools, stop) in rows.items():
        weighted = [*messages[:-1], {**messages[-1], "weight": weight}]
        ids = list(tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False))
        doc = tokenize_conversation(tok, weighted, 4096, tools=tools)
        assert list(doc.input_ids) == [*ids, stop], name
        # The appended token is trained with the turn's weight, as the rest of the turn; the labels
        # shift as for any token (it is predicted from the turn's last token).
        assert list(doc.loss_weights[-2:]) == [weight, weight], name
        assert masked_runs(tok, doc)[-1][0].endswith(tok.convert_ids_to_tokens(stop)), name
        # close_last_turn=false: exactly the template's ids, the turn's own tokens weighted the same.
        off = tokenize_conversation(tok, weighted, 4096, tools=tools, close_last_turn=False)
        assert list(off.input_ids) == ids, name
        assert list(off.loss_weights) == list(doc.loss_weights[:-1]), name
    # A row ending with a user message, or whose last turn is not trained, gets nothing appended.
    for messages in (R_CHAT[:4], R_CHAT[:6]):
        doc = tokenize_conversation(tok, messages, 4096)
        assert list(doc.input_ids) == list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
    untrained = [*R_CHAT[:-1], {**R_CHAT[-1], "weight": 0.0}]
    doc = tokenize_conversation(tok, untrained, 4096)
    assert list(doc.input_ids) == list(tok.apply_chat_template(R_CHAT, tokenize=True, return_dict=False))
    assert doc.loss_weights[-1] == 0.0


def test_closed_turns_get_nothing_appended():
    """ChatML, Kimi-K2, DeepSeek-V3.1 and MiniMax-M2 close every turn with their own end token."""
    cases = [(_demo_chatml_prefix_diff(), "chatml")] + [
        (_tokenizer(name), name) for name in ("kimi_k2_agent", "deepseek_v31_agent", "minimax_m2_agent")
    ]
    for tok, name in cases:
        rows = [(R_CHAT[1:3], None), (R_CHAT, None)] + ([] if name == "chatml" else [(AGENT, [WEATHER_TOOL])])
        for messages, tools in rows:
            ids = list(tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False))
            assert list(tokenize_conversation(tok, messages, 4096, tools=tools).input_ids) == ids, name


def test_glm_like_last_turn_without_a_stop_tag_is_an_error():
    # A template whose user header is plain text: a single-turn row's last turn has no tag to append.
    plain = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    plain.chat_template = GLM45_TEMPLATE.replace("<|user|>", "USER:")
    plain.add_tokens([t for t in GLM_TOKENS if t != "<|user|>"], special_tokens=True)
    plain.eos_token = "<|endoftext|>"
    with pytest.raises(RowError, match=r"^g\.jsonl:1: messages\[2\]: the last assistant turn .*data\.end_of_turn"):
        tokenize_conversation(plain, R_CHAT[:3], 4096, source="g.jsonl:1")
    doc = tokenize_conversation(plain, R_CHAT[:3], 4096, close_last_turn=False)
    assert list(doc.input_ids) == list(plain.apply_chat_template(R_CHAT[:3], tokenize=True, return_dict=False))


# The Qwen3.5 / 3.6 release templates on a longer agent row: two parallel calls after text (one with
# non-string arguments, which Qwen3.5 writes with Python's str and Qwen3.6 as JSON), two tool results in
# one user turn, a second user query, a call without text, and an answer without reasoning.
QWEN35_CALLS = [
    AGENT[0],
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            CALL,
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 2, "metric": True}},
            },
        ],
    },
    {"role": "tool", "content": '{"sky": "sunny"}'},
    {"role": "tool", "content": '{"sky": "rainy"}'},
    {"role": "assistant", "content": "Paris: sun. Rome: rain.", "reasoning_content": "Both known."},
    {"role": "user", "content": "And Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "One more call.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
    },
    {"role": "tool", "content": '{"sky": "snow"}'},
    {"role": "assistant", "content": "Oslo: snow."},
]


def _qwen_turns_as_rendered(text: str) -> list[str]:
    """Oracle read off the template's own render, independent of moe_sft.data.chat: per assistant turn, its
    text after `<|im_start|>assistant\\n` (and after the `<think>\\n` the generation prompt writes, which a
    turn after the last user query opens with) through its `<|im_end|>`; not the newline after that."""
    turns = []
    for block in text.split("<|im_start|>")[1:]:
        if block.startswith("assistant\n"):
            body = block.removeprefix("assistant\n").removeprefix("<think>\n")
            turns.append(body[: body.index("<|im_end|>") + len("<|im_end|>")])
    return turns


@pytest.mark.parametrize("template", ["qwen3_5", "qwen3_6"])
def test_qwen3_5_release_templates_train_each_turn_as_rendered(template):
    tok = _tokenizer(f"{template}_agent")
    # Thinking is on by default: the generation prompt opens the reasoning block, so it is not trained.
    prompt = tok.apply_chat_template(AGENT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    metric = "true" if template == "qwen3_6" else "True"
    rome = "<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
    calls = f"{QWEN35_CALL}\n<tool_call>\n<function=get_weather>\n{rome}<parameter=metric>\n{metric}\n</parameter>\n</function>\n</tool_call>"
    oslo = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    expected = {
        # One user query so far: both turns are rendered, and trained, with their reasoning.
        6: [
            f"Two cities, two calls.\n</think>\n\nChecking both.\n\n{calls}<|im_end|>",
            "Both known.\n</think>\n\nParis: sun. Rome: rain.<|im_end|>",
        ],
        # After the second query the same two turns are rendered without it, and trained as rendered; the
        # answer without reasoning gets the template's empty block, less the prompt's `<think>\n`.
        len(QWEN35_CALLS): [
            f"Checking both.\n\n{calls}<|im_end|>",
            "Paris: sun. Rome: rain.<|im_end|>",
            f"One more call.\n</think>\n\n{oslo}<|im_end|>",
            "\n</think>\n\nOslo: snow.<|im_end|>",
        ],
    }
    for n in (3, 6, 8, len(QWEN35_CALLS)):
        rows = QWEN35_CALLS[:n]
        text = tok.apply_chat_template(rows, tools=[WEATHER_TOOL], tokenize=False)
        ids = tok.apply_chat_template(rows, tools=[WEATHER_TOOL], tokenize=True, return_dict=False)
        doc = tokenize_conversation(tok, rows, 4096, tools=[WEATHER_TOOL])
        assert list(doc.input_ids) == list(ids), n
        runs = masked_runs(tok, doc)
        assert runs == [(t, 1.0) for t in _qwen_turns_as_rendered(text)], n
        if n in expected:
            assert [t for t, _ in runs] == expected[n]
        trained = "".join(t for t, _ in runs)
        for untrained in ("<|im_start|>", "<tool_response>", "You are a weather bot.", "Weather of a city", "Oslo?"):
            assert untrained not in trained, (n, untrained)


def test_qwen3_5_rows_the_template_refuses_name_the_row():
    """The release template raises for a row without a user query (and for a system message that is not
    first): the row fails with its file:line and the template's own message, nothing is guessed."""
    tok = _tokenizer("qwen3_5_agent")
    with pytest.raises(RowError, match=r"^q\.jsonl:4: the chat template rejected this row: No user query found"):
        tokenize_conversation(tok, [AGENT[0], {"role": "assistant", "content": "Hi."}], 4096, source="q.jsonl:4")
    late_system = [AGENT[1], {"role": "assistant", "content": "Hi."}, AGENT[0], AGENT[5], AGENT[6]]
    with pytest.raises(RowError, match=r"^q\.jsonl:5: .*System message must be at the beginning"):
        tokenize_conversation(tok, late_system, 4096, source="q.jsonl:5")


def test_qwen3_5_newlines_merged_across_the_prompt_end_are_trained():
    """Qwen's tokenizer writes the two newlines of an empty `<think>\\n\\n</think>` as one token: it holds the
    generation prompt's last character and the turn's first. It is trained (a token is trained when it
    overlaps a turn): it is what the model must produce after `<think>`, and the ids are the template's."""
    tok = _tokenizer("qwen3_5_chat")
    tok.add_tokens([AddedToken("\n\n", normalized=False)])  # the merge Qwen's BPE makes
    rows = [*R_CHAT[:-1], {"role": "assistant", "content": "8"}]
    doc = tokenize_conversation(tok, rows, 4096)
    text = tok.apply_chat_template(rows, tokenize=False)
    assert list(doc.input_ids) == list(tok.apply_chat_template(rows, tokenize=True, return_dict=False))
    assert "<think>\n\n</think>" in text
    assert [t for t, _ in masked_runs(tok, doc)] == ["4<|im_end|>", "6<|im_end|>", "\n\n</think>\n\n8<|im_end|>"]
    masked = tokenize_conversation(tok, rows, 4096, empty_think="mask")
    assert [t for t, _ in masked_runs(tok, masked)][-1] == "8<|im_end|>"


def test_qwen3_5_and_3_6_release_templates_are_the_pinned_files():
    """The fixtures are the release files byte for byte (sha256, sizes 7,756 / 7,764 B as released; see
    docs/data.md for where they come from), and differ in the two lines Qwen3.6 changed: the
    `preserve_thinking` switch and non-string tool arguments written as JSON."""
    assert hashlib.sha256(QWEN35_TEMPLATE.encode()).hexdigest() == (
        "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
    )
    assert hashlib.sha256(QWEN36_TEMPLATE.encode()).hexdigest() == (
        "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259"
    )
    old, new = QWEN35_TEMPLATE.splitlines(), QWEN36_TEMPLATE.splitlines()
    assert len(old) == len(new)
    changed = [i + 1 for i, (a, b) in enumerate(zip(old, new)) if a != b]
    assert changed == [100, 122]
    assert "preserve_thinking" in new[99] and "preserve_thinking" not in QWEN35_TEMPLATE
    assert "args_value | string if args_value is string" in new[121]
