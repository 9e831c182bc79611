"""Talk to `mlxinfer serve` with the official OpenAI client.

mlxinfer serve --port 8080 &          # in another terminal (pip install -e '.[server]')
pip install openai
python examples/openai_client.py
"""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="local")  # any key without --api-key
model = client.models.list().data[0].id

reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=64
)
print(reply.choices[0].message.content)
print(reply.usage)

for chunk in client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Write a haiku about the sea."}],
    max_tokens=64,
    stream=True,
):
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
