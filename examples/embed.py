"""Embedding mlxinfer in a program: a model handle, a request on a worker thread, a cancel.

python examples/embed.py [MODEL_DIR]
"""

import sys
import threading
import time

import mlxinfer

path = sys.argv[1] if len(sys.argv) > 1 else None  # None: the default model
with mlxinfer.ModelHandle(path, progress=lambda stage, done, total: None) as handle:
    print(handle.generate("Name three rivers.", chat_template=True, max_tokens=40))

    # A request on a worker thread, stopped from this one after half a second.
    stream = handle.start("Write a long story about the sea.", chat_template=True, max_tokens=400)
    pieces = []
    worker = threading.Thread(target=lambda: pieces.extend(r.text for r in stream))
    worker.start()
    time.sleep(0.5)
    stream.cancel()
    worker.join()
    print(f"\n[stopped after {len(pieces)} tokens]")
    m = handle.memory()
    print(f"weights {m['weights'] / 1e6:.0f} MB, MLX peak {m['peak'] / 1e6:.0f} MB")
