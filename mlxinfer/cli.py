"""The ``mlxinfer`` command: a thin shell over the Python API.

Each option maps one-to-one onto a keyword argument of ``stream_generate``,
``ChatSession`` or ``convert``. Generated text goes to stdout, everything
else (progress, stats, errors) to stderr.
"""

from __future__ import annotations

import functools
import json
import sys

import click

from .blas import preload_openblas
from .errors import MlxInferError


def _errors_to_click(fn):
    """Bad input → ``Error: <one line>`` on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (MlxInferError, ValueError) as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def _batch_sizes(text: str) -> list[int]:
    from .bench import parse_lengths

    try:
        return parse_lengths(text, "--batch")
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _log(message: str) -> None:
    click.echo(message, err=True)


def _template_args(ctx, param, values) -> dict | None:
    """``KEY=VALUE`` pairs as a dict, each VALUE as JSON if it parses (true, 3) else a string."""
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, found {item!r}", param=param)
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out or None


def generation_options(fn):
    options = [
        click.option(
            "--model",
            "-m",
            default=None,
            help="Model directory or Hub repo id [default: SmolLM2-135M-Instruct]",
        ),
        click.option(
            "--max-tokens", "-n", default=256, show_default=True, help="Most tokens to generate."
        ),
        click.option(
            "--temp",
            "temperature",
            default=0.0,
            show_default=True,
            help="Sampling temperature (0 = greedy).",
        ),
        click.option("--top-p", default=1.0, show_default=True),
        click.option("--top-k", default=0, show_default=True, help="0 = off."),
        click.option("--min-p", default=0.0, show_default=True),
        click.option("--repetition-penalty", default=None, type=float),
        click.option("--seed", default=None, type=int),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option(
            "--chat-template-arg",
            "chat_template_kwargs",
            multiple=True,
            metavar="KEY=VALUE",
            callback=_template_args,
            help="A variable for the chat template (repeatable; VALUE read as JSON when it "
            "parses): enable_thinking=false (Qwen3), reasoning_effort=high (gpt-oss).",
        ),
        click.option(
            "--max-kv-size",
            default=None,
            type=int,
            help="Keep at most this many tokens in the KV cache.",
        ),
        click.option(
            "--kv-bits", default=None, type=click.Choice(["4", "8"]), help="Quantize the KV cache."
        ),
        click.option(
            "--truncate-prompt",
            is_flag=True,
            help="Left-truncate a prompt longer than the context.",
        ),
        click.option(
            "--prefill-step-size",
            default=None,
            type=click.IntRange(1),
            help="Prompt tokens per prefill chunk; smaller lowers peak memory [default: 512].",
        ),
        click.option("--verbose", "-v", is_flag=True, help="Print the request timeline to stderr."),
        FORCE,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


FORCE = click.option(
    "--force",
    is_flag=True,
    help="Load the model even if it exceeds the GPU's recommended working set (Mac).",
)


def _load(model: str | None, verbose: bool, force: bool = False):
    """The model and tokenizer, with progress bars on a terminal."""
    from .loader import load
    from .progress import Bars

    if verbose:
        from .blas import blas_in_use

        _log(f"BLAS: {blas_in_use()}")
    if not sys.stderr.isatty():
        return load(model, log=_log, force=force)
    with Bars() as bars:
        return load(model, log=_log, progress=bars, force=force)


REASONING = click.option(
    "--reasoning",
    type=click.Choice(["show", "hide", "raw"]),
    default="show",
    show_default=True,
    help="A reasoning model's thoughts (<think> tags, gpt-oss's analysis channel): shown before "
    "the answer (dimmed on a terminal), hidden, or the output raw, markers and all.",
)


def _print_stream(results, verbose: bool, reasoning: str = "show") -> None:
    """Text to stdout as it comes (a reasoning model's thoughts first, dimmed on a terminal,
    unless hidden); with --verbose, the timeline to stderr at the end."""
    result, thought = None, False
    dim = sys.stdout.isatty()
    for result in results:
        if result.reasoning and reasoning == "show":
            click.echo(
                click.style(result.reasoning, dim=True) if dim else result.reasoning, nl=False
            )
            thought = True
        if result.text:
            if thought:
                click.echo("\n")  # a blank line between the thoughts and the answer
                thought = False
            click.echo(result.text, nl=False)
        sys.stdout.flush()
    click.echo()
    if verbose and result is not None:
        _log(result.stats.table())


@click.group()
@click.version_option(package_name="mlxinfer")
def cli():
    """On-device LLM inference on MLX."""


def speculative_options(fn):
    options = [
        click.option(
            "--draft-model",
            default=None,
            help="Speculative decoding with this draft model "
            "(directory or Hub repo id; same tokenizer as the model).",
        ),
        click.option(
            "--prompt-lookup",
            is_flag=True,
            help="Speculative decoding, drafting by copying from "
            "the prompt and the output so far (no second model).",
        ),
        click.option(
            "--self-draft-layers",
            default=None,
            type=int,
            help="Speculative decoding, drafting with "
            "the model's own first N layers (no second model).",
        ),
        click.option(
            "--num-draft",
            default=None,
            type=int,
            help="Tokens drafted per step [default: adapts to the acceptance rate].",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _make_draft(draft_model: str | None, prompt_lookup: bool, self_draft_layers: int | None):
    """The draft source the speculative flags ask for (at most one), or None."""
    from .generation.drafts import DraftModel, PromptLookup, SelfDraft

    chosen = [
        flag
        for flag, on in (
            ("--draft-model", draft_model is not None),
            ("--prompt-lookup", prompt_lookup),
            ("--self-draft-layers", self_draft_layers is not None),
        )
        if on
    ]
    if len(chosen) > 1:
        raise click.UsageError(f"choose one draft source, got {' and '.join(chosen)}")
    if draft_model is not None:
        from .loader import load

        return DraftModel(*load(draft_model, log=_log))
    if prompt_lookup:
        return PromptLookup()
    if self_draft_layers is not None:
        return SelfDraft(self_draft_layers)
    return None


def structured_options(fn):
    options = [
        click.option(
            "--json-schema",
            "json_schema",
            default=None,
            metavar="FILE",
            help="Output that validates against the JSON Schema in FILE.",
        ),
        click.option("--json", "json_object", is_flag=True, help="Output that is a JSON object."),
        click.option("--regex", default=None, help="Output that matches this regular expression."),
        click.option(
            "--choice",
            "choices",
            multiple=True,
            help="Output that is exactly one of these (repeat: --choice yes --choice no).",
        ),
        click.option(
            "--grammar",
            default=None,
            metavar="FILE",
            help="Output in the language of the Lark or GBNF grammar in FILE.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _constraint(json_schema, json_object, regex, choices, grammar):
    """The constraint the structured-output flags ask for (at most one), or None."""
    from pathlib import Path

    from .constraints import Constraint
    from .errors import ConstraintError

    chosen = [
        flag
        for flag, on in (
            ("--json-schema", json_schema is not None),
            ("--json", json_object),
            ("--regex", regex is not None),
            ("--choice", bool(choices)),
            ("--grammar", grammar is not None),
        )
        if on
    ]
    if len(chosen) > 1:
        raise click.UsageError(f"choose one constraint, got {' and '.join(chosen)}")

    def read(path: str) -> str:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConstraintError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None

    try:
        if json_schema is not None:
            return Constraint.json_schema(read(json_schema))
        if grammar is not None:
            return Constraint.grammar(read(grammar))
    except ConstraintError as e:
        path = json_schema if json_schema is not None else grammar
        raise ConstraintError(f"{path}: {e}") from None
    if json_object:
        return Constraint.json_object()
    if regex is not None:
        return Constraint.regex(regex)
    if choices:
        return Constraint.choices(choices)
    return None


CHAT_TEMPLATE_HELP = (
    "Chat format: a known one by name (gemma, chatml) or a Jinja file "
    "[default: the checkpoint's own]."
)


@cli.command()
@generation_options
@speculative_options
@structured_options
@click.option("--prompt", "-p", default=None, help="Prompt text; read from stdin when omitted.")
@click.option("--system", default=None, help="System message (chat template only).")
@click.option("--chat-template", default=None, metavar="NAME|FILE", help=CHAT_TEMPLATE_HELP)
@click.option("--no-chat-template", is_flag=True, help="Send the prompt as raw text.")
@REASONING
@click.option(
    "--batch",
    "batch_file",
    default=None,
    metavar="FILE",
    help="Run every prompt of FILE (one per line, or JSON lines) in one batch; "
    "prints one JSON line per prompt.",
)
@_errors_to_click
def generate(
    model,
    prompt,
    batch_file,
    system,
    chat_template,
    no_chat_template,
    reasoning,
    kv_bits,
    verbose,
    draft_model,
    prompt_lookup,
    self_draft_layers,
    json_schema,
    json_object,
    regex,
    choices,
    grammar,
    **options,
):
    """Generate a completion and stream it to stdout.

    The prompt goes through the model's chat template when it has one; a
    model without one (a base model) gets the prompt as raw text.
    """
    from .generation import stream_generate

    if chat_template and no_chat_template:
        raise click.UsageError("choose --chat-template or --no-chat-template, not both")
    # Checked before the model loads: a bad schema is an error at once.
    options["constraint"] = _constraint(json_schema, json_object, regex, choices, grammar)
    if batch_file is not None:
        return _generate_batch(
            batch_file,
            model,
            prompt,
            system,
            chat_template,
            no_chat_template,
            kv_bits,
            verbose,
            (draft_model, prompt_lookup, self_draft_layers),
            options,
        )
    if prompt is None:
        prompt = sys.stdin.read()
    llm, tokenizer = _load(model, verbose, options.pop("force"))
    options["draft"] = _make_draft(draft_model, prompt_lookup, self_draft_layers)
    [prompt] = _templated(tokenizer, [prompt], system, chat_template, no_chat_template, verbose)
    _print_stream(
        stream_generate(
            llm,
            tokenizer,
            prompt,
            kv_bits=int(kv_bits) if kv_bits else None,
            split_reasoning=reasoning != "raw",
            **options,
        ),
        verbose,
        reasoning,
    )


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
):
    """``generate --batch FILE``: every prompt through one engine, a JSON line each, in order;
    drafts by prompt lookup or with a draft model."""
    import json

    from .batch import batch_generate
    from .batch.prompts import read_prompts

    draft_model, prompt_lookup, self_draft_layers = drafts
    num_draft = options.pop("num_draft", None)
    unsupported = {
        "--prompt": prompt is not None,
        "--max-kv-size": options.pop("max_kv_size") is not None,
        "--prefill-step-size": options.pop("prefill_step_size") is not None,
        "--self-draft-layers": self_draft_layers is not None,
    }
    if clash := [name for name, given in unsupported.items() if given]:
        raise click.UsageError(f"--batch does not take {', '.join(clash)} yet")
    if num_draft is not None and not (prompt_lookup or draft_model):
        raise click.UsageError(
            "--num-draft needs a draft source (--batch drafts by --prompt-lookup or --draft-model)"
        )
    draft = _make_draft(draft_model, prompt_lookup, None)
    prompts = read_prompts(batch_file)
    llm, tokenizer = _load(model, verbose, options.pop("force"))
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
        **options,
    )
    for i, text in enumerate(texts):
        click.echo(json.dumps({"index": i, "text": text}, ensure_ascii=False))


@cli.command()
@generation_options
@speculative_options
@click.option("--system", default=None, help="System message.")
@click.option("--chat-template", default=None, metavar="NAME|FILE", help=CHAT_TEMPLATE_HELP)
@REASONING
@_errors_to_click
def chat(
    model,
    system,
    chat_template,
    reasoning,
    kv_bits,
    verbose,
    max_kv_size,
    draft_model,
    prompt_lookup,
    self_draft_layers,
    **options,
):
    """Interactive chat; keeps history and reuses the KV cache across turns.

    Type /reset to clear the history, /exit (or Ctrl-D) to quit.
    """
    from .chat import ChatSession

    llm, tokenizer = _load(model, verbose, options.pop("force"))
    if chat_template:
        tokenizer.set_chat_template(chat_template)
    options["draft"] = _make_draft(draft_model, prompt_lookup, self_draft_layers)
    if not tokenizer.has_chat_template:
        raise click.ClickException(
            f"{tokenizer.path}: no chat template (a base model?); name a known format "
            "with --chat-template, or complete raw text with `mlxinfer generate`"
        )
    session = ChatSession(
        llm,
        tokenizer,
        system=system,
        max_kv_size=max_kv_size,
        kv_bits=int(kv_bits) if kv_bits else None,
        split_reasoning=reasoning != "raw",
        **options,
    )
    while True:
        try:
            line = input(">> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            session.reset()
            continue
        _print_stream(session.send(line), verbose, reasoning)


@cli.command()
@click.option(
    "--model",
    "-m",
    default=None,
    help="Model directory or Hub repo id [default: SmolLM2-135M-Instruct]",
)
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
    "--kv-bits", default=None, type=click.Choice(["4", "8"]), help="Quantize the KV pool."
)
@click.option("--prompt-lookup", is_flag=True, help="Speculative decoding by prompt lookup.")
@click.option(
    "--draft-model",
    default=None,
    help="Speculative decoding with this draft model (directory or Hub repo id): every request "
    "drafts with it, each with its own draft cache. It must share the model's tokenizer "
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
    help="Seconds a --models-dir model stays loaded while idle.",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    help="Let pages from this origin call the API from a browser (repeatable; '*' for any). "
    "Default: no CORS headers.",
)
@click.option("--verbose", "-v", is_flag=True)
@FORCE
@_errors_to_click
def serve(
    model,
    host,
    port,
    api_key,
    max_batch,
    kv_budget,
    kv_bits,
    prompt_lookup,
    draft_model,
    models_dir,
    keep_alive,
    cors_origins,
    verbose,
    force,
):
    """Serve the model over an OpenAI-compatible HTTP API (docs/server.md)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise click.ClickException(
            f"serve needs FastAPI and uvicorn ({e.name} is missing): pip install 'mlxinfer[server]'"
        ) from None
    from pathlib import Path

    from .server import serve as run

    draft = _make_draft(draft_model, prompt_lookup, None)
    llm = tokenizer = name = None
    if model is not None or models_dir is None:  # with --models-dir alone: only those
        llm, tokenizer = _load(model, verbose, force)
        name = Path(model).name if model else "SmolLM2-135M-Instruct"
    options = {"max_batch": max_batch, "kv_budget": kv_budget}
    options = {k: v for k, v in options.items() if v is not None}
    if kv_bits:
        options["kv_bits"] = int(kv_bits)
    served = ", ".join(n for n in [name, models_dir and f"the models in {models_dir}"] if n)
    _log(f"serving {served} on http://{host}:{port} (OpenAI and Anthropic APIs under /v1)")
    run(
        llm,
        tokenizer,
        name,
        host=host,
        port=port,
        api_key=api_key,
        draft=draft,
        models_dir=Path(models_dir) if models_dir else None,
        keep_alive=keep_alive if models_dir else None,
        cors_origins=list(cors_origins),
        **options,
    )


@cli.command()
@click.argument("src")
@click.option(
    "--output", "-o", "dst", required=True, help="Output directory (must not exist or be empty)."
)
@click.option(
    "--quantize",
    "-q",
    is_flag=True,
    help="Quantize Linear/Embedding weights (GGUF without --dtype: re-quantize only its K-quant "
    "tensors to --bits/--group-size).",
)
@click.option(
    "--bits", default=4, show_default=True, type=click.Choice(["2", "3", "4", "5", "6", "8"])
)
@click.option("--group-size", default=64, show_default=True, type=click.Choice(["32", "64", "128"]))
@click.option(
    "--dtype",
    default=None,
    type=click.Choice(["float16", "bfloat16", "float32"]),
    help="Float dtype of the output; a GGUF is dequantized to it [default: the checkpoint's; "
    "a GGUF keeps its own types].",
)
@_errors_to_click
def convert(src, dst, quantize, bits, group_size, dtype):
    """Convert a Hugging Face checkpoint (directory or repo id) or a GGUF file."""
    from .conversion import convert as run_convert

    report = run_convert(
        src,
        dst,
        quantize=quantize,
        bits=int(bits),
        group_size=int(group_size),
        dtype=dtype,
        progress=True,
        log=_log,
    )
    _log(
        f"wrote {report['path']}: {report['parameters'] / 1e6:.1f}M parameters, "
        f"{report['bits_per_weight']:.2f} bits per weight, {report['bytes'] / 2**20:.1f} MiB on disk"
    )


@cli.command()
@click.option(
    "--model",
    "-m",
    default=None,
    help="Model directory or Hub repo id [default: SmolLM2-135M-Instruct]",
)
@click.option(
    "--prompt-tokens",
    "-p",
    default="128,512,2048",
    show_default=True,
    metavar="P[,P...]",
    help="Prompt lengths, comma-separated (seeded random token ids).",
)
@click.option(
    "--max-tokens",
    "-n",
    default="128",
    show_default=True,
    metavar="N",
    help="Tokens generated per run (at least 2).",
)
@click.option(
    "--reps",
    default="3",
    show_default=True,
    metavar="R",
    help="Timed runs per prompt length, after one warm-up.",
)
@click.option(
    "--kv-bits", default=None, type=click.Choice(["4", "8"]), help="Quantize mlxinfer's KV cache."
)
@click.option(
    "--prefill-step-size",
    default=None,
    type=click.IntRange(1),
    help="Prompt tokens per prefill chunk, for both engines [default: each engine's own: "
    "mlxinfer 512, mlx-lm 2048].",
)
@click.option(
    "--compare",
    default=None,
    type=click.Choice(["mlx-lm"]),
    help="Also run mlx-lm's own benchmark (a child process) and print mlxinfer / mlx-lm.",
)
@click.option(
    "--plot",
    default=None,
    metavar="PATH",
    help="Write prefill and decode tok/s against prompt length (PNG).",
)
@click.option(
    "--json",
    "json_path",
    default=None,
    metavar="PATH",
    help="Write every run, medians, ratios and the roofline.",
)
@click.option(
    "--batch",
    "batch_sizes",
    default=None,
    metavar="B[,B...]",
    callback=lambda ctx, param, v: None if v is None else _batch_sizes(v),
    help="Benchmark the batching engine at these batch sizes (aggregate decode tok/s) "
    "with one prompt length.",
)
@_errors_to_click
def bench(
    model,
    prompt_tokens,
    max_tokens,
    reps,
    kv_bits,
    prefill_step_size,
    compare,
    plot,
    json_path,
    batch_sizes,
):
    """Benchmark prefill, decode, TTFT and peak memory per prompt length.

    Progress goes to stderr, the tables alone to stdout.
    """
    from . import bench as b
    from .bench import report
    from .default_model import default_model_path
    from .loader import resolve_model_path

    lengths = b.parse_lengths(prompt_tokens, "-p/--prompt-tokens")
    max_tokens = b.parse_count(max_tokens, "-n/--max-tokens", 2)
    reps = b.parse_count(reps, "--reps", 1)
    # Every check that can fail runs before the (long) measurement.
    if compare:
        b.require_mlx_lm()
    if plot:
        report.require_matplotlib()
        plot = report.check_writable(plot, "--plot")
    if json_path:
        json_path = report.check_writable(json_path, "--json")
    model_dir = default_model_path(log=_log) if model is None else resolve_model_path(model)
    llm, _ = _load(str(model_dir), verbose=True)
    if batch_sizes is not None:
        return _bench_batch(
            llm, model_dir, batch_sizes, lengths, max_tokens, reps, compare, json_path
        )
    result = b.run_benchmark(
        llm,
        model_dir,
        lengths,
        max_tokens=max_tokens,
        reps=reps,
        kv_bits=int(kv_bits) if kv_bits else None,
        prefill_step=prefill_step_size,
        compare=compare,
        log=_log,
    )
    click.echo(report.tables(result))
    if json_path:
        _log(f"wrote {report.write_json(result, json_path)}")
    if plot:
        _log(f"wrote {report.write_plot(result, plot)}")


def _bench_batch(llm, model_dir, batch_sizes, lengths, max_tokens, reps, compare, json_path):
    from .bench import batch, report

    if len(lengths) != 1:
        raise click.UsageError("--batch takes one prompt length (-p P)")
    result = batch.run_batch_benchmark(
        llm, model_dir, batch_sizes, lengths[0], max_tokens, reps, compare, _log
    )
    click.echo(batch.batch_tables(result))
    if json_path:
        _log(f"wrote {report.write_json(result, json_path)}")


def main() -> None:
    preload_openblas()  # before anything imports mlx
    cli()
