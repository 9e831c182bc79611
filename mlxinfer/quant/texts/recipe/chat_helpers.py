"""Message constructors for the authored conversations (chat-template shape: a tool call's
arguments are a JSON object, as Hugging Face chat templates expect)."""

import json


def S(content):  # noqa: N802
    return {"role": "system", "content": content}


def U(content):  # noqa: N802
    return {"role": "user", "content": content}


def A(content):  # noqa: N802
    return {"role": "assistant", "content": content}


def call(call_id, name, arguments):
    function = {"name": name, "arguments": arguments}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def result(call_id, name, value):
    content = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
