"""Small chat templates in the tool-call and reasoning styles, written after Qwen2.5's (Hermes),
Llama 3.2's, Mistral's (v3), gpt-oss's (harmony) and Qwen3's / DeepSeek-R1's (think tags) own,
for tiny test models."""

HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. <tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'For each call return <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

LLAMA3 = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{%- endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{%- if loop.last and tools %}Given the following functions, please respond with a JSON for "
    'a function call with its proper arguments. Respond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}.'
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n\n{%- endif %}"
    "{{ m.content }}<|eot_id|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)

MISTRAL = (
    "{%- for m in messages %}{%- if loop.last and tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}[TOOL_CALLS] {{ m.tool_calls | map(attribute='function') | list | tojson }}</s>"
    "{%- else %}{{ m.content }}</s>{%- endif %}{%- endfor %}"
)

# gpt-oss's harmony format: a system message with the date and the reasoning effort, tools as a
# TypeScript-like namespace, an assistant's call as a message to its recipient, and a refusal
# of an analysis channel passed back in the content (the real template raises there too).
HARMONY = (
    "{%- macro system() -%}<|start|>system<|message|>Knowledge cutoff: 2024-06\n"
    "Current date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}<|end|>{%- endmacro -%}"
    "{{- system() }}"
    "{%- if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for t in tools %}\n// {{ t.function.description }}\ntype {{ t.function.name }} = "
    "(_: {{ t.function.parameters | tojson }}) => any;{%- endfor %}\n}<|end|>{%- endif %}"
    "{%- set last = namespace(name=none) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if '<|channel|>' in (m.content or '') %}"
    "{{- raise_exception('pass the analysis in thinking, not in content') }}{%- endif %}"
    "{%- if m.tool_calls %}{%- set c = m.tool_calls[0].function %}"
    "<|start|>assistant to=functions.{{ c.name }}<|channel|>commentary json<|message|>"
    "{{ c.arguments | tojson }}<|call|>{%- set last.name = c.name %}"
    "{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>"
    "commentary<|message|>{{ m.content | tojson }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
HARMONY_SPECIALS = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|constrain|>",
]

# Qwen3's: the reply thinks in <think> tags; past replies go back without their thoughts;
# enable_thinking=False writes an empty thought into the prompt.
THINK = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and '</think>' in m.content %}"
    "{{ m.content.split('</think>')[-1].lstrip() }}{%- else %}{{ m.content }}{%- endif %}"
    "<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}"
)
# DeepSeek-R1's: the generation prompt opens the thought itself.
THINK_OPENED = THINK.replace(
    "{%- if enable_thinking is defined", "<think>\n{%- if enable_thinking is defined"
)

SPECIALS = {
    "mistral": ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "</s>"],
    "harmony": HARMONY_SPECIALS,
}
