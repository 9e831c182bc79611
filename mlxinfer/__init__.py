"""mlxinfer: on-device LLM inference on Apple's MLX.

Public API::

    model, tokenizer = mlxinfer.load("path/or/org-repo")   # None: the default model
    text = mlxinfer.generate(model, tokenizer, "Hello", max_tokens=64)
    for r in mlxinfer.stream_generate(model, tokenizer, "Hello"):
        print(r.text, end="")
    mlxinfer.convert("hf-dir-or-repo", "out-dir", quantize=True)
    mlxinfer.verify("out-dir").ok        # every file's size and SHA-256 against its manifest
    mlxinfer.perplexity(["q4-dir"], reference="f32-dir")   # PPL, KLD, top-1 on the same tokens
    stream_generate(..., draft=mlxinfer.PromptLookup())     # speculative decoding
    texts = mlxinfer.batch_generate(model, tokenizer, ["Hi", "Hello"])  # one batch
    engine = mlxinfer.Engine(model)   # continuous batching: engine.stream(tokenizer, prompt)
    handle = mlxinfer.ModelHandle(path, keep_alive=300)   # for apps: load, unload, cancel
    async for r in mlxinfer.astream_generate(handle, "Hello"): ...
    vectors = mlxinfer.embed(model, tokenizer, ["a text", "another"])  # an embedding checkpoint

Importing this package loads nothing heavy: the modules (and MLX) load on first
use of an attribute. On Linux it does one thing first: it loads a fast BLAS for
MLX's CPU backend when one is installed, which only works before MLX is imported
(platform/blas.py; docs/blas.md).
"""

from importlib import import_module

from .platform.blas import preload_openblas

preload_openblas()

__version__ = "0.1.0"

_EXPORTS = {
    "generate": "generation",
    "stream_generate": "generation",
    "GenerationResult": "generation.results",
    "GenerationStats": "generation.results",
    "SamplingParams": "generation.sampling",
    "OutputRules": "generation.rules",
    "convert": "loading.convert",
    "verify": "files.manifest",
    "perplexity": "quality.perplexity",
    "make_sampler": "generation.sampling",
    "make_logits_processors": "generation.sampling",
    "PromptCache": "cache.prompt",
    "DraftModel": "generation.drafts",
    "MTP": "generation.mtp_drafts",
    "PromptLookup": "generation.drafts",
    "SelfDraft": "generation.drafts",
    "ChatSession": "generation.chat",
    "Tokenizer": "tokenization",
    "MlxInferError": "errors",
    "batch_generate": "batch",
    "Engine": "batch",
    "EngineConfig": "batch",
    "ModelHandle": "handle",
    "astream_generate": "handle",
    "Constraint": "output.constraints",
    "embed": "embeddings",
    "Pooling": "embeddings",
    "read_pooling": "embeddings",
}

__all__ = sorted([*_EXPORTS, "load"])

# ``load``'s keywords that only one rank's part takes, or only the whole model's.
_RANK_OPTIONS = ("rank_timeout", "rank_memory", "micro_batches", "head_on_first")
_WHOLE_OPTIONS = ("progress", "force", "kv_budget")


def load(path_or_repo=None, *, distributed: str | None = None, **options):
    """The model ``path_or_repo`` names and its tokenizer: ``(model, tokenizer)``.

    A model directory, a ``.gguf`` file, a Hub repo id, or None (the default model): the whole
    model (:func:`mlxinfer.loading.loader.load`: ``dtype``, ``log``, ``progress``, ``force``,
    ``kv_budget``); with ``distributed="pipeline"|"tensor"`` this rank's part of it
    (:func:`mlxinfer.distributed.load`: ``rank_timeout``, ``rank_memory``, ``micro_batches``,
    ``head_on_first``, ``dtype``, ``log``). The other's keywords are accepted and ignored.
    """
    if distributed is None:
        from .loading.loader import load as load_whole

        return load_whole(path_or_repo, **_without(options, _RANK_OPTIONS))
    from .distributed import load as load_part

    return load_part(path_or_repo, distributed, **_without(options, _WHOLE_OPTIONS))


def _without(options: dict, names: tuple[str, ...]) -> dict:
    return {k: v for k, v in options.items() if k not in names}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'mlxinfer' has no attribute '{name}'")
