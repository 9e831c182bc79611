"""``serve``'s request limits as options (``limit_options``), and the byte-count values they take.

The values go to :func:`mlxinfer.server.make_app` unchanged (mlxinfer/server/limits.py checks
them and supplies the defaults for those left unset).
"""

from __future__ import annotations

import click


def _size(ctx, param, value: str | None) -> int | None:
    """A byte count: ``1048576``, ``64K``, ``32M``, ``1G`` (powers of 1024; ``KiB`` too)."""
    if value is None:
        return None
    text = value.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit():
        raise click.BadParameter(
            f"expected a byte count such as 1048576, 64K or 32M, found {value!r}"
        )
    return int(digits) * scale


def _hosts(ctx, param, values) -> list[str] | None:
    hosts = [h.strip() for v in values for h in v.split(",") if h.strip()]
    return hosts or None


def limit_options(fn):
    """``serve``'s request limits (mlxinfer/server/limits.py; None: its defaults)."""
    options = [
        click.option(
            "--max-body",
            callback=_size,
            help="Largest request body, e.g. 32M; larger is a 413 [default: 32M].",
        ),
        click.option(
            "--max-header-bytes",
            callback=_size,
            help="Most bytes of request headers; more is a 431 [default: 64K].",
        ),
        click.option(
            "--max-headers",
            type=click.IntRange(1),
            help="Most request headers; more is a 431 [default: 100].",
        ),
        click.option(
            "--body-timeout",
            type=click.FloatRange(min=0, min_open=True),
            help="Seconds a client has to send its whole body; then a 408 [default: 30].",
        ),
        click.option(
            "--max-queue",
            type=click.IntRange(0),
            help="Most requests waiting for a place in the batch; past it a 503 with "
            "Retry-After [default: 256].",
        ),
        click.option(
            "--allowed-hosts",
            multiple=True,
            callback=_hosts,
            help="Host names (comma-separated or repeated; '*' any, '*.lan' subdomains) answered "
            "besides localhost and loopback addresses. Default: only those when bound to a "
            "loopback address (a DNS-rebinding defence), any host otherwise.",
        ),
        click.option(
            "--max-images",
            type=click.IntRange(0),
            help="Most images in one request; more is a 413 [default: 8].",
        ),
        click.option(
            "--max-image-bytes",
            callback=_size,
            help="Largest image (encoded: a data URL's decoded bytes, a fetched body); larger is "
            "a 413 [default: 20M].",
        ),
        click.option(
            "--max-image-pixels",
            type=click.IntRange(1),
            help="Most pixels (width x height, as the header declares) in one image; more is a "
            "400 [default: 50000000].",
        ),
        click.option(
            "--allow-remote-images",
            is_flag=True,
            default=None,
            help="Fetch http(s) image URLs (under --max-image-bytes, 10 s each); without it they "
            "are a 400 and only data URLs are taken. The server then makes requests its clients "
            "name: allow it only for clients you trust.",
        ),
        click.option(
            "--shutdown-timeout",
            type=click.FloatRange(min=0, min_open=True),
            help="Seconds SIGTERM waits for cancelled responses to end [default: 5].",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn
