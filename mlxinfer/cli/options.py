"""The CLI's shared pieces: option groups (generation, speculative decoding, structured output,
reasoning), how their values become the API's arguments, and loading and printing.

``serve``'s request limits are in limits.py (importable from here too)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from ..errors import MlxInferError
from .limits import _hosts as _hosts
from .limits import _size as _size
from .limits import limit_options as limit_options


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
    from ..bench import parse_lengths

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


# Every command's model: a directory, a .gguf file (imported once) or a Hub repo id.
model_option = click.option(
    "--model",
    "-m",
    default=None,
    help="Model directory, .gguf file or Hub repo id [default: SmolLM2-135M-Instruct]",
)


def generation_options(fn):
    options = [
        model_option,
        click.option(
            "--max-tokens", "-n", default=256, show_default=True, help="Most tokens to generate."
        ),
        click.option(
            "--temperature",
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
            type=click.IntRange(min=5),
            help="Keep at most this many tokens in the KV cache (the first 4 always, then the "
            "latest; at least 5).",
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
        click.option(
            "--prompt-cache-file",
            default=None,
            metavar="FILE",
            type=click.Path(dir_okay=False),
            help="Resume from this session's cache file when it holds this model's cache (the "
            "prompt's common prefix is reused; another model's or a damaged file: a warning and "
            "a cold start) and write the cache to it after the run.",
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
    help="Load the model even if its weights and KV cache exceed the memory this machine can "
    "give (the GPU's recommended working set on a Mac, available RAM elsewhere), and let a "
    "generation's KV cache grow past it.",
)


def _load(
    model: str | None,
    verbose: bool,
    force: bool = False,
    kv_budget: int | None = None,
    distributed: dict | None = None,
):
    """The model and tokenizer, with progress bars on a terminal; ``kv_budget``: the KV bytes
    its engine will hold (``serve``), None for a single generation's (loader.check_fits).
    ``distributed``: this rank's part instead, ``mlxinfer.distributed.load``'s keywords
    (a command's ``Setting.load``, cli/distributed.py)."""
    from ..loading.loader import load
    from ..platform.progress import Bars

    if verbose:
        from ..backends import kernels
        from ..platform.blas import blas_in_use

        _log(f"BLAS: {blas_in_use()}")
        _log(kernels.describe())  # the compiled CPU kernels in use, or why not (one line)
    if distributed:  # this rank's part (a rank reads only its tensors: no bars)
        from ..distributed import load as load_part

        loaded = load_part(model, log=_log, **distributed)
    elif not sys.stderr.isatty():
        loaded = load(model, log=_log, force=force, kv_budget=kv_budget)
    else:
        with Bars() as bars:
            loaded = load(model, log=_log, progress=bars, force=force, kv_budget=kv_budget)
    if verbose:
        from ..backends import describe
        from ..backends.cpu import plans

        chosen = describe(loaded[0]).get("cpu_plans")
        if chosen:  # the CPU backend's decode plans in use (timed at load, or cached, or forced)
            timed = getattr(loaded[0], "cpu_plans_timed", None)
            when = f" (timed {timed})" if timed else ""
            _log(f"CPU decode plans{when}: {plans.describe({'plans': chosen})}")
    return loaded


REASONING = click.option(
    "--reasoning",
    type=click.Choice(["show", "hide", "raw"]),
    default="show",
    show_default=True,
    help="A reasoning model's thoughts (<think> tags, gpt-oss's analysis channel): shown before "
    "the answer (dimmed on a terminal), hidden, or the output raw, markers and all.",
)


def _print_stream(results, verbose: bool, reasoning: str = "show", out=None) -> None:
    """Text to ``out`` (None: stdout) as it comes (a reasoning model's thoughts first, dimmed
    on a terminal, unless hidden); with --verbose, the timeline to stderr at the end."""
    result, thought = None, False
    out = sys.stdout if out is None else out
    dim = out.isatty()
    for result in results:
        if result.reasoning and reasoning == "show":
            click.echo(
                click.style(result.reasoning, dim=True) if dim else result.reasoning,
                out,
                nl=False,
            )
            thought = True
        if result.text:
            if thought:
                click.echo("\n", out)  # a blank line between the thoughts and the answer
                thought = False
            click.echo(result.text, out, nl=False)
        out.flush()
    click.echo(file=out)
    if verbose and result is not None:
        _log(result.stats.table())


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
            "--mtp",
            is_flag=True,
            help="Speculative decoding, drafting with the model's own "
            "multi-token-prediction head (MiMo; no second model).",
        ),
        click.option(
            "--mtp-head",
            default=None,
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="--mtp with this head from 'mlxinfer train-mtp -o' (a model without shipped "
            "heads; one saved in the model's directory is found without it).",
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


def _make_draft(
    draft_model: str | None,
    prompt_lookup: bool,
    self_draft_layers: int | None,
    mtp: bool | Path = False,
    *,
    keep: bool = True,
):
    """The draft source the speculative flags ask for (at most one), or None. ``mtp``: True, or
    ``--mtp-head``'s path. ``keep``: an MTP head keeps its cache across requests (chat turns;
    they run one at a time)."""
    from ..generation.drafts import DraftModel, PromptLookup, SelfDraft
    from ..generation.mtp_drafts import MTP

    chosen = [
        flag
        for flag, on in (
            ("--draft-model", draft_model is not None),
            ("--prompt-lookup", prompt_lookup),
            ("--self-draft-layers", self_draft_layers is not None),
            ("--mtp", mtp),
        )
        if on
    ]
    if len(chosen) > 1:
        raise click.UsageError(f"choose one draft source, got {' and '.join(chosen)}")
    if draft_model is not None:
        from ..loading.loader import load

        return DraftModel(*load(draft_model, log=_log))
    if prompt_lookup:
        return PromptLookup()
    if self_draft_layers is not None:
        return SelfDraft(self_draft_layers)
    if mtp:
        head = mtp if isinstance(mtp, Path) else None  # --mtp-head's trained head
        return MTP(keep_cache=keep, head=head)  # chat turns: the head resumes from its own cache
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

    from ..errors import ConstraintError
    from ..output.constraints import Constraint

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
