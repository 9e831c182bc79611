"""``mlxinfer serve``: the HTTP server's command (docs/server.md).

Its options map onto :func:`mlxinfer.server.make_app`'s keyword arguments, named alike: the
engine's (batch, KV pool: :class:`~mlxinfer.batch.EngineConfig`'s fields), the request limits
(``limit_options``) and the agent-serving ones (``agent_options``: chat template, model aliases,
output cap, embeddings, the disk prefix tier, the recurrent-state snapshots). An option left
unset is not passed, so the server's own default applies.
"""

from __future__ import annotations

from pathlib import Path

import click

from .distributed import distributed_options
from .options import (
    CHAT_TEMPLATE_HELP,
    FORCE,
    _errors_to_click,
    _load,
    _log,
    _make_draft,
    _size,
    limit_options,
    model_option,
)

OLLAMA_ADDRESS = ("127.0.0.1", 11434)  # where Ollama listens, and its apps look by default


def _served_name(model: str | None) -> str:
    """The name a model given to ``serve -m`` is served as: a file's stem or a folder's name,
    a store model's store name (``org/name:latest``), the default model's name."""
    from pathlib import Path

    from ..loading.loader import store_path
    from ..store import parse_name

    if not model:
        return "SmolLM2-135M-Instruct"
    path = Path(model).expanduser()
    if not path.exists() and (stored := store_path(model)) is not None:
        if (stored / "config.json").is_file():
            return str(parse_name(model))
    return path.stem if model.endswith(".gguf") else path.name


def agent_options(fn):
    """What serving coding agents needs: a chat template for a model without one, the model
    names clients send, a cap on every request's output, an embedding model, the prefix
    cache's disk tier, and for a model with recurrent layers its snapshots' budget and spacing."""
    options = [
        click.option(
            "--chat-template",
            default=None,
            metavar="NAME|FILE",
            help="Chat template for the served model (a model without one needs it). "
            + CHAT_TEMPLATE_HELP,
        ),
        click.option(
            "--model-alias",
            "model_aliases",
            multiple=True,
            metavar="GLOB=NAME",
            help="Serve a client's model name matching GLOB as the served model NAME, e.g. "
            "'claude-*=SmolLM2-135M-Instruct' (repeatable; without one an unknown name is a 404).",
        ),
        click.option(
            "--max-output-tokens",
            default=None,
            type=click.IntRange(min=1),
            help="Cap every request's output at N tokens (finish reason max_tokens/length).",
        ),
        click.option(
            "--embedding-model",
            default=None,
            metavar="DIR",
            help="Also serve this embedding checkpoint on /v1/embeddings (under its directory's "
            "name).",
        ),
        click.option(
            "--prefix-cache-dir",
            default=None,
            type=click.Path(file_okay=False),
            help="Keep the prefix cache's full blocks on disk here too, so a restart starts warm "
            "(servers may share it).",
        ),
        click.option(
            "--prefix-cache-disk-bytes",
            default=None,
            callback=_size,
            metavar="N",
            help="Most bytes the disk prefix tier keeps (K/M/G suffixes) [default: 10G].",
        ),
        click.option(
            "--prefix-state-bytes",
            default=None,
            callback=_size,
            metavar="N",
            help="For a model with recurrent layers: bytes of --kv-budget kept for snapshots of "
            "their states, which let requests share prefixes (K/M/G suffixes; 0: no sharing) "
            "[default: a quarter].",
        ),
        click.option(
            "--prefix-state-every",
            default=None,
            type=click.IntRange(min=1),
            metavar="BLOCKS",
            help="For a model with recurrent layers: snapshot their states every BLOCKS blocks "
            "of prefill, and at each prompt's last full block [default: a prefill chunk's].",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.command()
@model_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option(
    "--api-key",
    default=None,
    envvar="MLXINFER_API_KEY",
    help="Require 'Authorization: Bearer KEY' on /v1/ [env: MLXINFER_API_KEY].",
)
@click.option("--max-batch", default=None, type=int, help="Most requests decoded together.")
@click.option("--kv-budget", default=None, type=int, help="Bytes the KV pool may hold.")
@click.option(
    "--kv-reserve/--kv-grow",
    default=True,
    help="Take the whole --kv-budget at start, which keeps the server's memory flat all day "
    "[default], or grow the KV pool with the load (and give a burst's back).",
)
@click.option(
    "--kv-bits", default=None, type=click.Choice(["4", "8"]), help="Quantize the KV pool."
)
@click.option("--prompt-lookup", is_flag=True, help="Speculative decoding by prompt lookup.")
@click.option(
    "--mtp",
    is_flag=True,
    help="Speculative decoding with the model's own multi-token-prediction head (MiMo, GLM-4.5, "
    "DeepSeek-V3, Qwen3-Next, Qwen3.5).",
)
@click.option(
    "--mtp-head",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="--mtp with this head from 'mlxinfer train-mtp -o' (a model without shipped heads).",
)
@click.option(
    "--draft-model",
    default=None,
    help="Speculative decoding with this draft model (directory or Hub repo id): every request "
    "drafts with it (their draft steps batched together). It must share the model's tokenizer "
    "vocabulary.",
)
@click.option(
    "--models-dir",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="Also serve every converted model in this directory (by its directory's name), loaded "
    "on first use.",
)
@click.option(
    "--keep-alive",
    default=300.0,
    show_default=True,
    type=float,
    help="Seconds a --models-dir or store model stays loaded while idle.",
)
@click.option(
    "--ollama",
    is_flag=True,
    help="Also listen on 127.0.0.1:11434, Ollama's address, for apps that only find Ollama "
    "there (Ollama's API is served on --port either way, under /api).",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    help="Let pages from this origin call the API from a browser (repeatable; '*' for any). "
    "Default: no CORS headers.",
)
@agent_options
@limit_options
@click.option("--verbose", "-v", is_flag=True)
@FORCE
@distributed_options
@_errors_to_click
def serve(
    model,
    host,
    port,
    api_key,
    max_batch,
    kv_budget,
    kv_reserve,
    kv_bits,
    prompt_lookup,
    mtp,
    mtp_head,
    draft_model,
    models_dir,
    keep_alive,
    ollama,
    cors_origins,
    verbose,
    force,
    chat_template,
    model_aliases,
    max_output_tokens,
    embedding_model,
    prefix_cache_dir,
    prefix_cache_disk_bytes,
    prefix_state_bytes,
    prefix_state_every,
    setting,
    **limits,
):
    """Serve the model over OpenAI's, Anthropic's and Ollama's HTTP APIs (docs/server.md)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise click.ClickException(
            f"serve needs FastAPI and uvicorn ({e.name} is missing): pip install 'mlxinfer[server]'"
        ) from None
    from pathlib import Path

    from ..batch.pool import DEFAULT_KV_BUDGET
    from ..server import serve as run
    from ..store import store_root

    budget = kv_budget or DEFAULT_KV_BUDGET
    if prefix_state_bytes is not None and prefix_state_bytes > budget:
        raise click.BadParameter(
            f"expected at most the KV budget ({budget} bytes), found {prefix_state_bytes}",
            param_hint="'--prefix-state-bytes'",
        )
    draft = _make_draft(
        draft_model, prompt_lookup, None, mtp_head or mtp, keep=False
    )  # concurrent requests
    llm = tokenizer = name = None
    if model is not None or models_dir is None:  # with --models-dir alone: only those
        llm, tokenizer = _load(model, verbose, force, budget, distributed=setting.load)
        name = _served_name(model)
    options = {"max_batch": max_batch, "kv_budget": kv_budget}
    options = {k: v for k, v in options.items() if v is not None}
    options["kv_reserve"] = kv_reserve
    options.update(setting.engine)  # across ranks: micro_batches
    if kv_bits:
        options["kv_bits"] = int(kv_bits)
    agent = {
        "chat_template": chat_template,
        "model_aliases": list(model_aliases) or None,
        "max_output_tokens": max_output_tokens,
        "embedding_model": embedding_model,
        "prefix_cache_dir": prefix_cache_dir,
        "prefix_cache_disk_bytes": prefix_cache_disk_bytes,
        "prefix_state_bytes": prefix_state_bytes,  # the Engine's (EngineConfig)
        "prefix_state_every": prefix_state_every,
    }
    served = ", ".join(
        n for n in [name, models_dir and f"the models in {models_dir}", "the store's models"] if n
    )
    if getattr(getattr(llm, "ranks", None), "first", True):  # across ranks: rank 0 serves
        from ..store import record_server

        record_server(host, port)  # where `mlxinfer ps`, `stop` and `rm` find this server
        _log(
            f"serving {served} on http://{host}:{port} (OpenAI and Anthropic APIs under /v1, "
            "Ollama's under /api)"
            + (f", and on http://{OLLAMA_ADDRESS[0]}:{OLLAMA_ADDRESS[1]}" if ollama else "")
        )
    run(
        llm,
        tokenizer,
        name,
        host=host,
        port=port,
        api_key=api_key,
        draft=draft,
        models_dir=Path(models_dir) if models_dir else None,
        store=store_root(),  # the pulled models, by their store names, loaded on first use
        keep_alive=keep_alive,
        cors_origins=list(cors_origins),
        **({"also": [OLLAMA_ADDRESS]} if ollama else {}),
        **options,
        **{k: v for k, v in agent.items() if v is not None},
        **{k: v for k, v in limits.items() if v is not None},  # None: the server's defaults
    )
