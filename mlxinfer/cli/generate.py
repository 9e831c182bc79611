"""``mlxinfer generate`` and ``mlxinfer chat``: thin shells over ``stream_generate``,
``batch_generate`` and ``ChatSession``, each option one keyword argument. Generated text goes
to stdout, everything else (progress, stats, errors) to stderr.
"""

from __future__ import annotations

import json
import sys

import click

from .distributed import distributed_options
from .options import (
    CHAT_TEMPLATE_HELP,
    REASONING,
    _constraint,
    _errors_to_click,
    _load,
    _log,
    _make_draft,
    _print_stream,
    generation_options,
    speculative_options,
    structured_options,
)


@click.command()
@generation_options
@speculative_options
@structured_options
@click.option("--prompt", "-p", default=None, help="Prompt text; read from stdin when omitted.")
@click.option("--system", default=None, help="System message (chat template only).")
@click.option("--chat-template", default=None, metavar="NAME|FILE", help=CHAT_TEMPLATE_HELP)
@click.option("--no-chat-template", is_flag=True, help="Send the prompt as raw text.")
@click.option(
    "--image",
    "images",
    multiple=True,
    metavar="PATH",
    help="An image for a model with a vision tower (Gemma 3), before the prompt's text in its "
    "user message; repeatable. With --batch: the images of every prompt.",
)
@REASONING
@click.option(
    "--batch",
    "batch_file",
    default=None,
    metavar="FILE",
    help="Run every prompt of FILE (one per line, or JSON lines) in one batch; "
    "prints one JSON line per prompt.",
)
@distributed_options
@_errors_to_click
def generate(
    model,
    prompt,
    batch_file,
    system,
    chat_template,
    no_chat_template,
    images,
    reasoning,
    kv_bits,
    verbose,
    draft_model,
    prompt_lookup,
    self_draft_layers,
    mtp,
    mtp_head,
    json_schema,
    json_object,
    regex,
    choices,
    grammar,
    setting,
    **options,
):
    """Generate a completion and stream it to stdout.

    The prompt goes through the model's chat template when it has one; a
    model without one (a base model) gets the prompt as raw text.
    """
    from ..generation import stream_generate

    mtp = mtp_head or mtp  # --mtp-head: --mtp with that head
    if chat_template and no_chat_template:
        raise click.UsageError("choose --chat-template or --no-chat-template, not both")
    # Checked before the model loads: a bad schema is an error at once.
    options["constraint"] = _constraint(json_schema, json_object, regex, choices, grammar)
    cache_file = options.pop("prompt_cache_file")
    if images and (clash := _image_clash(batch_file, no_chat_template, cache_file)):
        raise click.UsageError(f"--image does not go with {clash}")
    if batch_file is not None:
        if cache_file is not None:
            raise click.UsageError("--prompt-cache-file keeps one session: not with --batch")
        return _generate_batch(
            batch_file,
            model,
            prompt,
            system,
            chat_template,
            no_chat_template,
            kv_bits,
            verbose,
            (draft_model, prompt_lookup, self_draft_layers, mtp),
            options,
            setting,
            list(images) or None,
        )
    if prompt is None:
        prompt = sys.stdin.read()
    llm, tokenizer = _load(model, verbose, options["force"], distributed=setting.load)
    if options.pop("force"):  # lifts the KV budget too (what the machine can give now)
        options["kv_budget"] = float("inf")
    options["draft"] = _make_draft(draft_model, prompt_lookup, self_draft_layers, mtp)
    [prompt] = _templated(tokenizer, [prompt], system, chat_template, no_chat_template, verbose)
    kv_bits = int(kv_bits) if kv_bits else None
    pc, fingerprint = _session_cache(
        cache_file, llm, kv_bits, options.get("max_kv_size"), options["draft"], verbose
    )
    _print_stream(
        stream_generate(
            llm,
            tokenizer,
            prompt,
            kv_bits=kv_bits,
            split_reasoning=reasoning != "raw",
            prompt_cache=pc,
            images=list(images) or None,
            **options,
        ),
        verbose,
        reasoning,
        setting.out,
    )
    if cache_file is not None:
        from ..cache.prompt_file import save

        # Across ranks, each rank's own file; an MTP head's kept cache beside the model's.
        save(cache_file, pc, fingerprint, llm, options["draft"])


def _image_clash(batch_file, no_chat_template, cache_file) -> str | None:
    """The option given with --image that cannot take images, and why (or None)."""
    if no_chat_template:
        return "--no-chat-template (images need the template's image markers)"
    if cache_file is not None:  # keyed by token ids, which are the same for every image
        return "--prompt-cache-file (a cache of token ids cannot tell images apart)"
    return None


def _session_cache(path, llm, kv_bits, max_kv_size, draft=None, verbose=False):
    """(the prompt cache to run with, its fingerprint): ``--prompt-cache-file``'s, or (None,
    None) without one (prompt_cache_file.py). An MTP ``draft`` takes the head cache the file
    keeps, if it is its head's (``-v`` says what became of it)."""
    if path is None:
        return None, None
    from ..cache.prompt_file import open_cache

    pc, fingerprint, warning = open_cache(
        path,
        llm,
        kv_bits=kv_bits,
        max_kv_size=max_kv_size,
        draft=draft,
        log=_log if verbose else None,
    )
    if warning:
        _log(f"warning: {warning}")
    return pc, fingerprint


def _templated(tokenizer, prompts, system, chat_template, no_chat_template, verbose) -> list:
    """The prompts as chat messages (a text as one user turn, after ``--system``) when the model
    has a template and ``--no-chat-template`` is not given; otherwise as they are."""
    if chat_template:
        tokenizer.set_chat_template(chat_template)
    use_template = not no_chat_template and tokenizer.has_chat_template
    if system and not use_template:
        raise click.UsageError(
            "--system needs a chat template"
            + (
                ""
                if no_chat_template
                else f": {tokenizer.path} has none (name one with --chat-template)"
            )
        )
    if not use_template:
        if not no_chat_template and verbose:
            _log(
                f"{tokenizer.path}: no chat template, so the prompt goes to the model as raw "
                "text (--chat-template NAME to use a known format)"
            )
        return list(prompts)
    head = [{"role": "system", "content": system}] if system else []
    return [
        head + (p if isinstance(p, list) else [{"role": "user", "content": p}]) for p in prompts
    ]


def _generate_batch(
    batch_file,
    model,
    prompt,
    system,
    chat_template,
    no_chat_template,
    kv_bits,
    verbose,
    drafts,
    options,
    setting,
    images=None,
):
    """``generate --batch FILE``: every prompt through one engine, a JSON line each, in order;
    drafts by prompt lookup, with a draft model or with the MTP head. ``images`` (``--image``):
    every prompt's, before its text (``batch_generate(images=...)``: decoded and encoded once)."""

    from ..batch import batch_generate
    from ..batch.prompts import read_prompts

    draft_model, prompt_lookup, self_draft_layers, mtp = drafts
    num_draft = options.pop("num_draft", None)
    unsupported = {
        "--prompt": prompt is not None,
        "--max-kv-size": options.pop("max_kv_size") is not None,
        "--prefill-step-size": options.pop("prefill_step_size") is not None,
        "--self-draft-layers": self_draft_layers is not None,
    }
    if clash := [name for name, given in unsupported.items() if given]:
        raise click.UsageError(f"--batch does not take {', '.join(clash)} yet")
    if num_draft is not None and not (prompt_lookup or draft_model or mtp):
        raise click.UsageError(
            "--num-draft needs a draft source (--batch drafts by --prompt-lookup, "
            "--draft-model or --mtp)"
        )
    draft = _make_draft(draft_model, prompt_lookup, None, mtp)
    prompts = read_prompts(batch_file)
    llm, tokenizer = _load(model, verbose, options.pop("force"), distributed=setting.load)
    prompts = _templated(tokenizer, prompts, system, chat_template, no_chat_template, verbose)
    stop = options.pop("stop")
    kv_bits = int(kv_bits) if kv_bits else None
    texts = batch_generate(
        llm,
        tokenizer,
        prompts,
        stop=stop,
        constraint=options.pop("constraint"),
        draft=draft,
        num_draft=num_draft,
        kv_bits=kv_bits,
        images=images,
        **setting.engine,
        **options,
    )
    for i, text in enumerate(texts):
        click.echo(json.dumps({"index": i, "text": text}, ensure_ascii=False), setting.out)


@click.command()
@generation_options
@speculative_options
@click.option("--system", default=None, help="System message.")
@click.option("--chat-template", default=None, metavar="NAME|FILE", help=CHAT_TEMPLATE_HELP)
@click.option(
    "--image",
    "images",
    multiple=True,
    metavar="PATH",
    help="An image for the first message (a model with a vision tower); repeatable. "
    "In the chat, /image PATH adds one to the next message.",
)
@REASONING
@distributed_options
@_errors_to_click
def chat(
    model,
    system,
    chat_template,
    images,
    reasoning,
    kv_bits,
    verbose,
    max_kv_size,
    draft_model,
    prompt_lookup,
    self_draft_layers,
    mtp,
    mtp_head,
    setting,
    **options,
):
    """Interactive chat; keeps history and reuses the KV cache across turns.

    Type /reset to clear the history, /image PATH to add an image to the next message,
    /exit (or Ctrl-D) to quit.
    """
    from ..generation.chat import ChatSession

    mtp = mtp_head or mtp  # --mtp-head: --mtp with that head
    llm, tokenizer = _load(model, verbose, options["force"], distributed=setting.load)
    if options.pop("force"):  # lifts the KV budget too (what the machine can give now)
        options["kv_budget"] = float("inf")
    if chat_template:
        tokenizer.set_chat_template(chat_template)
    options["draft"] = _make_draft(draft_model, prompt_lookup, self_draft_layers, mtp)
    if not tokenizer.has_chat_template:
        raise click.ClickException(
            f"{tokenizer.path}: no chat template (a base model?); name a known format "
            "with --chat-template, or complete raw text with `mlxinfer generate`"
        )
    cache_file = options.pop("prompt_cache_file")
    kv_bits = int(kv_bits) if kv_bits else None
    session = ChatSession(
        llm,
        tokenizer,
        system=system,
        max_kv_size=max_kv_size,
        kv_bits=kv_bits,
        split_reasoning=reasoning != "raw",
        **options,
    )
    pc, fingerprint = _session_cache(
        cache_file, llm, kv_bits, max_kv_size, options["draft"], verbose
    )
    if pc is not None:
        session.prompt_cache = pc
    pending = list(images)  # images for the next message
    while True:
        try:
            line = setting.read_line(">> ")  # in chat --distributed, rank 0's on every rank
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            session.reset()
            continue
        if line.strip().startswith("/image "):
            pending.append(line.strip().removeprefix("/image ").strip())
            continue
        _print_stream(session.send(line, pending), verbose, reasoning, setting.out)
        pending = []
    if cache_file is not None:
        from ..cache.prompt_file import save

        save(cache_file, session.prompt_cache, fingerprint, llm, options["draft"])
