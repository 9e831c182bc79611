"""``mlxinfer train-mtp``: a thin shell over :func:`mlxinfer.training.mtp.train_mtp`: train a
multi-token-prediction head for a model that ships none, then ``--mtp`` drafts with it."""

from __future__ import annotations

from pathlib import Path

import click

from .options import _errors_to_click, _load, _log


@click.command("train-mtp")
@click.argument("model", required=False)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The head's file [default: mtp_head.safetensors in the model's directory, where "
    "--mtp finds it; elsewhere, give it to --mtp-head].",
)
@click.option(
    "--prompts",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A text file of prompts, one per line, for the model to answer [default: the 64 "
    "shipped with mlxinfer].",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=8, max=8192),
    default=192,
    show_default=True,
    help="The length of each answer the model writes.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1, max=1_000_000),
    default=300,
    show_default=True,
    help="Optimiser steps.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1, max=256),
    default=8,
    show_default=True,
    help="Sequences per step.",
)
@click.option(
    "--learning-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=1e-4,
    show_default=True,
    help="AdamW's peak learning rate (cosine decay).",
)
@click.option(
    "--draft-vocab",
    type=click.IntRange(min=0),
    default=8192,
    show_default=True,
    help="The head drafts over the tokens the model wrote most, at most this many (a fraction "
    "of the LM head per draft); 0: the whole vocabulary.",
)
@click.option(
    "--chain-weight",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="The chained step's share of the loss (the head fed its own output: drafts past the "
    "first); 0 trains the first draft alone.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling and batching seed.")
@click.option("--verbose", "-v", is_flag=True, help="Print the BLAS and kernels in use.")
@_errors_to_click
def train_mtp(
    model,
    output,
    prompts,
    max_tokens,
    steps,
    batch_size,
    learning_rate,
    draft_vocab,
    chain_weight,
    seed,
    verbose,
):
    """Train an MTP head for MODEL (default: the default model) on text it writes itself.

    The head is one decoder block of the model's own family, trained to predict the token
    after next from the model's last hidden state (self-distillation: docs/speculative.md).
    Then `mlxinfer generate --mtp` drafts with it."""
    from ..training.mtp import train_mtp as run

    llm, tokenizer = _load(model, verbose)
    texts = None
    if prompts is not None:
        texts = [t.strip() for t in prompts.read_text(encoding="utf-8").splitlines() if t.strip()]
    report = run(
        llm,
        tokenizer,
        output=output,
        prompts=texts,
        max_tokens=max_tokens,
        steps=steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        draft_vocab=draft_vocab,
        chain_weight=chain_weight,
        seed=seed,
        log=_log,
    )
    click.echo(
        f"{report.path}: held-out top-1 agreement {report.top1_after:.1%} "
        f"(untrained {report.top1_before:.1%}), chained {report.top1_chained_after:.1%} "
        f"(untrained {report.top1_chained_before:.1%}), KL {report.kl_after:.3f} "
        f"(untrained {report.kl_before:.3f}); {report.sequences} sequences, {report.tokens} "
        f"tokens, {report.steps} steps in {report.generate_s + report.train_s:.0f} s"
    )
