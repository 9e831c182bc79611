"""Two requests streamed at once under asyncio, with the event loop free.

python examples/async_chat.py [MODEL_DIR]
"""

import asyncio
import sys

import mlxinfer


async def ask(handle, name: str, question: str) -> str:
    text = []
    async for r in mlxinfer.astream_generate(handle, question, chat_template=True, max_tokens=48):
        text.append(r.text)
    return f"{name}: {''.join(text)}"


async def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else None
    with mlxinfer.ModelHandle(path) as handle:
        answers = await asyncio.gather(
            ask(handle, "rivers", "Name three rivers."),
            ask(handle, "colours", "Name three colours."),
        )
    print("\n".join(answers))


asyncio.run(main())
