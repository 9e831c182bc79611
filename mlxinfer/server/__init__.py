"""``mlxinfer serve``: an OpenAI- and Anthropic-compatible HTTP server on the batching engine.

FastAPI and uvicorn (``pip install 'mlxinfer[server]'``). Routes: ``/health`` (is the
engine thread alive), ``/metrics`` (Prometheus), ``/v1/models``, ``/v1/chat/completions``,
``/v1/completions`` (``openai``) and ``/v1/messages`` (``anthropic``), streamed as
server-sent events or not. docs/server.md says what is supported.
"""

from __future__ import annotations

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080


def make_app(*args, **kwargs):
    from .app import make_app as make

    return make(*args, **kwargs)


def serve(
    model, tokenizer, name: str, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, **options
) -> None:
    """Serve until interrupted."""
    import uvicorn

    uvicorn.run(make_app(model, tokenizer, name, **options), host=host, port=port, log_level="info")
