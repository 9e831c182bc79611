"""``mlxinfer serve``: an OpenAI- and Anthropic-compatible HTTP server on the batching engine.

FastAPI and uvicorn (``pip install 'mlxinfer[server]'``). Routes: ``/health`` (is the
engine thread alive), ``/metrics`` (Prometheus), ``/v1/models``, ``/v1/chat/completions``,
``/v1/completions`` (``openai``), ``/v1/messages`` (``anthropic``), streamed as
server-sent events or not, and Ollama's ``/api/`` (``ollama``). docs/server.md says what is supported; ``limits`` what a request
may be.
"""

from __future__ import annotations

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080


def make_app(*args, **kwargs):
    from .app import make_app as make

    return make(*args, **kwargs)


def serve(
    model,
    tokenizer,
    name: str,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    allowed_hosts: list[str] | None = None,
    also: list[tuple[str, int]] = (),
    **options,
) -> None:
    """Serve until interrupted (SIGINT or SIGTERM: in-flight requests are cancelled and the
    process ends within seconds). Bound to a loopback address, only requests naming this
    machine in ``Host`` are answered, unless ``allowed_hosts`` names more; bound to another
    address, any host is (``allowed_hosts`` defaults to ``["*"]``). ``also``: more
    ``(host, port)`` listeners for the same app (``serve --ollama``: Ollama's 127.0.0.1:11434)."""
    from ..distributed import serving
    from .limits import is_loopback
    from .run import server

    if serving.across_ranks(model):  # rank 0 serves, the others follow (distributed/serving.py)
        serving.check_options(options)
        options["rank0_requests"] = True
        if not model.ranks.first:
            serving.follow(model, serving.engine_options(options))
            return
    if allowed_hosts is None and not is_loopback(host):
        allowed_hosts = ["*"]
    app = make_app(model, tokenizer, name, allowed_hosts=allowed_hosts, **options)
    if serving.across_ranks(model):
        serving.lead(model, app)
    server(app, host, port, also=also).run()
