"""The caches: the per-layer KV cache behind one protocol (``kv.py``), its rotating, quantized and
recurrent-state kinds, the prompt cache kept across turns, and its file on disk.

``from mlxinfer.cache import KVCache`` keeps working: the KV cache's names are re-exported here.
Modules inside this package import from ``.kv`` directly.
"""

from .kv import (  # noqa: F401
    Cache,
    KVCache,
    LatentKVCache,
    Pages,
    StateCache,
    cache_nbytes,
    is_trimmable,
    restore_cache,
    snapshot_cache,
    trim_cache,
)
from .rotating import RotatingKVCache  # noqa: F401
