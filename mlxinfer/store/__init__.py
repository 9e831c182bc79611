"""The model store: models pulled from the Hugging Face Hub, converted once, kept by name
under the cache root (layout.py), and the models other apps downloaded, found read-only.

    from mlxinfer import store
    store.pull("HuggingFaceTB/SmolLM2-135M-Instruct", progress=callback)   # converted with -q
    store.pull("org/Model-GGUF:Q4_K_M")        # one quant of a GGUF repo, its own quantization
    store.entries()                            # what is there (and in other apps' folders)
    store.show("org/name")                     # architecture, context, quantization, fits...
    store.copy("org/name", "mine"); store.remove("mine", force=False)
    store.record_server(host, port)            # serve: where ps / stop / rm find it

A name is ``org/name[:variant]`` (names.py); ``mlxinfer.load("org/name")`` and every command
taking a model find a pulled one before asking the Hub (loading/loader.py's resolution).
"""

from .catalog import copy, entries, remove, show
from .layout import store_root
from .names import ModelName, StoreError, parse_name
from .pull import DEFAULT_RECIPE, pull
from .servers import forget_server, record_server, running_models, server_url, stop_model

__all__ = [
    "DEFAULT_RECIPE",
    "ModelName",
    "StoreError",
    "copy",
    "entries",
    "forget_server",
    "parse_name",
    "pull",
    "record_server",
    "remove",
    "running_models",
    "server_url",
    "show",
    "stop_model",
    "store_root",
]
