"""Tool-call JSON in OpenAI's shapes (tool definitions, chat-completion responses carrying
tool_calls with JSON-string arguments, tool results), generated from a seed (written for
mlxinfer, MIT)."""

import json
import random

CITIES = [
    "Oslo",
    "Nairobi",
    "Lima",
    "Osaka",
    "Tbilisi",
    "Porto",
    "Winnipeg",
    "Hanoi",
    "Cork",
    "Perth",
]
WORDS = [
    "quarterly",
    "report",
    "invoice",
    "backup",
    "design",
    "review",
    "sprint",
    "budget",
    "launch",
    "audit",
]


def _value(r, name, schema):
    kind = schema.get("type")
    if "enum" in schema:
        return r.choice(schema["enum"])
    if kind == "integer":
        return r.randint(1, 500) if "year" not in name else r.randint(1995, 2025)
    if kind == "number":
        return round(r.uniform(1, 2000), r.choice([0, 1, 2]))
    if kind == "boolean":
        return r.random() < 0.5
    if kind == "array":
        return [
            f"{r.choice(WORDS)}{r.randint(1, 99)}@example.org"
            if "mail" in schema.get("description", "").lower()
            else r.choice(WORDS)
            for _ in range(r.randint(1, 4))
        ]
    desc = schema.get("description", "").lower()
    if "city" in desc or "place" in desc or "address" in desc:
        return r.choice(CITIES)
    if "language" in desc:
        return r.choice(["fr", "de", "ja", "es-MX", "zh-Hans", "ru", "pt-BR"])
    if "symbol" in desc:
        return r.choice(["ACME", "GLOBX", "INITK", "UMBR"])
    if "code" in desc and "currenc" in desc:
        return r.choice(["EUR", "USD", "JPY", "GBP", "CHF", "INR", "BRL"])
    if "iata" in desc:
        return r.choice(["LHR", "CDG", "NRT", "JFK", "GRU", "SYD", "DEL", "CPT"])
    if "date" in desc or "time" in desc:
        return f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}" + (
            ""
            if "date" in desc
            else f"T{r.randint(7, 19):02d}:{r.choice(['00', '15', '30', '45'])}:00Z"
        )
    if "path" in desc:
        return "/".join(
            r.sample(["src", "docs", "lib", "tests", "data", "notes"], r.randint(1, 3))
        ) + r.choice([".md", ".py", ".csv", ""])
    if "select" in desc:
        return f"SELECT {r.choice(WORDS)}_id, COUNT(*) FROM {r.choice(WORDS)}s WHERE year = {r.randint(2015, 2024)} GROUP BY 1"
    if "expression" in desc:
        return f"({r.randint(2, 99)} + {r.randint(2, 99)}) * {r.randint(2, 19)} / {r.randint(2, 9)}"
    if "sku" in desc:
        return f"{r.choice(['KT', 'LP', 'MG', 'TB'])}-{r.randint(100, 999)}-{r.choice(['BL', 'RD', 'WH'])}"
    return " ".join(r.choice(WORDS) for _ in range(r.randint(1, 5)))


def arguments(r, tool):
    params = tool["function"]["parameters"]
    out = {}
    for name, schema in params["properties"].items():
        if name in params["required"] or r.random() < 0.5:
            out[name] = _value(r, name, schema)
    return out


def documents(seed, tools, count):
    """One document of tool definitions, then ``count`` responses with tool calls and results."""
    r = random.Random(seed)
    docs = ["Tools offered to the model:\n" + json.dumps(tools, indent=2, ensure_ascii=False)]
    for i in range(count):
        picked = r.sample(tools, r.choice([1, 1, 1, 2]))
        calls = []
        for tool in picked:
            calls.append(
                {
                    "id": f"call_{r.getrandbits(48):012x}",
                    "type": "function",
                    "function": {
                        "name": tool["function"]["name"],
                        "arguments": json.dumps(arguments(r, tool), ensure_ascii=False),
                    },
                }
            )
        response = {
            "id": f"chatcmpl-{r.getrandbits(64):016x}",
            "object": "chat.completion",
            "created": 1735689600 + r.randint(0, 30_000_000),
            "model": "assistant",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "tool_calls": calls},
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": r.randint(80, 900), "completion_tokens": r.randint(12, 80)},
        }
        indent = r.choice([None, 2])
        text = json.dumps(response, indent=indent, ensure_ascii=False)
        results = [
            json.dumps(
                {
                    "role": "tool",
                    "tool_call_id": c["id"],
                    "content": json.dumps({"ok": True, "request": i + 1}),
                }
            )
            for c in calls
        ]
        docs.append(text + "\n" + "\n".join(results))
    return docs
