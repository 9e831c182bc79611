"""Talk to `mlxinfer serve` with the official Anthropic client (the Messages API).

mlxinfer serve --port 8080 &          # in another terminal (pip install -e '.[server]')
pip install anthropic
python examples/anthropic_client.py
"""

import anthropic

client = anthropic.Anthropic(base_url="http://127.0.0.1:8080", api_key="local")
model = "SmolLM2-135M-Instruct"  # the served model's name (GET /v1/models)

message = client.messages.create(
    model=model,
    system="Answer in one sentence.",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=64,
)
print(message.content[0].text, message.stop_reason, message.usage)

with client.messages.stream(
    model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=64
) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()
