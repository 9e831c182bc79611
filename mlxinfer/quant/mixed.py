"""A calibrated mixed-precision plan for one model: calibration pass, measured costs, choice.

``plan_model`` is what ``convert --bpw / --max-bytes / --recipe`` (and ``-q`` alone) run on
the float model before :func:`~mlxinfer.quant.transform.quantize_model` applies the plan:

1. the calibration tokens' importance per input channel (``calibrate.calibrate``), unless an
   importance file was given; for GPTQ rounding also each layer's input covariance (the pass
   then runs even with an importance file: no file holds them);
2. a named recipe's settings, or for a budget: each tensor's weighted error at every
   candidate setting and its KL divergence at the probe setting (``plan.measure``), then the
   cheapest plan within the budget (``budget.choose_with_head``);
3. the plan's predicted KL (the summed costs) beside what it is measured to be with every
   planned tensor quantized together (one more pass over the probe tokens).

Given ``weights`` (fresh lazy loads, as ``convert`` passes), each of these passes runs layer by
layer, about one block's weights resident at a time (:mod:`mlxinfer.quant.layerwise`), with
the same figures up to the order of float sums.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .. import backends
from ..errors import ConfigError
from ..models.base import embedding_rows
from . import layerwise
from .budget import budget_from_bpw, check_fits, choose_with_head, plan_bytes
from .calibrate import Probe, calibrate, calibration_sequences
from .covariances import CovarianceStore
from .plan import (
    Setting,
    Tensor,
    apply_overrides,
    fake_quantized,
    measure,
    parse_overrides,
    quantizable,
    recipe_settings,
)

CALIBRATION_TOKENS = 4096  # the importance pass: 8 sequences of 512
PROBE_TOKENS = 256  # each tensor's KL probe: one sequence (a forward pass per tensor)
CTX = 512


@dataclass
class Plan:
    """A mixed-precision plan and what it was measured to cost."""

    settings: dict[str, Setting]
    bytes: int  # of the planned tensors
    budget: int | None  # bytes allowed for them (None: a recipe)
    predicted_kl: float | None  # summed per-tensor costs (None: a recipe, not measured)
    measured_kl: float | None  # every planned tensor quantized together, on the probe tokens
    tokens: int  # calibration tokens
    seconds: float
    importance: dict[str, np.ndarray] = field(default_factory=dict)  # path -> mean x**2
    sums: dict[str, np.ndarray] = field(default_factory=dict)  # path -> sum x**2 (saved)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    costs: dict[str, dict] = field(default_factory=dict)  # path -> {alpha, errors{"b:g": e}}
    # path -> mean x x^T (on disk when planned layer by layer: covariances.CovarianceStore)
    covariances: Mapping[str, np.ndarray] = field(default_factory=dict)

    def layers(self) -> dict[str, tuple[int, int]]:
        return {p: (s.bits, s.group_size) for p, s in self.settings.items()}

    def mean(self, path: str) -> np.ndarray | None:
        return self.importance.get(path)

    def covariance(self, path: str) -> np.ndarray | None:
        return self.covariances.get(path)

    def drop_covariances(self) -> None:
        """Let the covariances go (their files removed, where on disk): after the rounding."""
        store, self.covariances = self.covariances, {}
        if isinstance(store, CovarianceStore):
            store.close()

    def record(self) -> dict:
        """What ``quantization-plan.json`` keeps: the choice, its figures and the measured
        costs (reused by ``--plan-from`` to plan another budget without measuring again)."""
        return {
            "settings": {p: _key(s) for p, s in self.settings.items()},
            "bytes": self.bytes,
            "budget": self.budget,
            "predicted_kl": self.predicted_kl,
            "measured_kl": self.measured_kl,
            "calibration_tokens": self.tokens,
            "seconds": round(self.seconds, 1),
            "costs": self.costs,
        }

    def summary(self) -> str:
        """One line per distinct setting: how many tensors and parameters."""
        by: dict[Setting, int] = {}
        for s in self.settings.values():
            by[s] = by.get(s, 0) + 1
        parts = [f"{n} x {s}" for s, n in sorted(by.items(), key=lambda kv: -kv[1])]
        return ", ".join(parts)


def _plan_model(
    model: nn.Module,
    token_lists: Sequence[Sequence[int]],
    *,
    vocab: int,
    bos: int | None = None,
    bpw: float | None = None,
    max_bytes: int | None = None,
    recipe: str | None = None,
    overrides: Sequence[str] = (),
    importance: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None,
    costs: dict[str, dict] | None = None,
    covariance: bool = False,
    calibration_tokens: int = CALIBRATION_TOKENS,
    probe_tokens: int = PROBE_TOKENS,
    weights: Callable[[], dict[str, mx.array]] | None = None,
    log: Callable[[str], None] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Plan:
    """Plan per-tensor settings for the float ``model``.

    Args:
        token_lists: calibration documents, tokenized (never the evaluation text).
        bpw: bits per parameter of the whole weight files; or ``max_bytes`` of them.
        recipe: a named recipe (``plan.recipe_settings``) instead of a budget.
        overrides: ``PATTERN=BITS[:GROUP]`` settings forced on matching tensors.
        importance: ``(sums, counts)`` read from a file (``--imatrix``); None: measured here.
        costs: a previous plan's measured costs (``Plan.costs``, saved in
            ``quantization-plan.json``) for the same model: no probe per tensor.
        covariance: also record each layer's input covariance (``Plan.covariances``, for
            GPTQ rounding); the calibration pass runs even when ``importance`` is given.
        weights: fresh lazy loads of the model's parameters by path (``model``'s own are
            lazy loads too): plan layer by layer, each block's weights put back as lazy loads
            once a pass is through it (:mod:`mlxinfer.quant.layerwise`), so about one block is
            resident at a time. None: the model as it is in memory.
    """
    if sum(x is not None for x in (bpw, max_bytes, recipe)) != 1:
        raise ConfigError("a plan takes exactly one of bpw, max_bytes or recipe")
    start = time.monotonic()
    say = log or (lambda _: None)
    rows = embedding_rows(model)
    if rows is not None:  # a tokenizer may know more ids than the embedding has rows
        token_lists = [[t for t in tokens if t < rows] for tokens in token_lists]
        vocab = min(vocab, rows)
    positions = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    ctx = min(CTX, positions) if isinstance(positions, int) and positions > 0 else CTX
    sequences = calibration_sequences(token_lists, ctx=ctx, max_tokens=calibration_tokens, bos=bos)
    if not sequences:
        raise ConfigError("calibration: the calibration text gave no tokens")
    n_tokens = sum(len(s) for s in sequences)
    covariances: Mapping[str, np.ndarray] = {}
    resident = layerwise.Resident(model, weights) if weights is not None else None
    if importance is None or covariance:
        what = " (input covariances too, for GPTQ)" if covariance else ""
        say(f"calibration: {n_tokens} tokens in {len(sequences)} sequences{what}")
        if resident is not None:
            stats = layerwise.calibrate(
                model, sequences, resident, covariance=covariance, progress=progress
            )
        else:
            stats = calibrate(model, sequences, covariance=covariance, progress=progress)
        covariances = stats.covariances
        if importance is None:
            importance = (stats.sums, stats.counts)
    sums, counts = importance
    means = {
        p: sums[p] / np.maximum(counts[p], 1)[..., None]
        if sums[p].ndim == 2
        else sums[p] / max(int(counts[p]), 1)
        for p in sums
    }

    tensors = quantizable(model, getattr(model, "quant_predicate", None))
    apply_overrides(tensors, parse_overrides(overrides))
    tokens = sequences[0][:probe_tokens]
    stream = layerwise.StreamProbe(model, resident, tokens, vocab) if resident else None
    probe: Probe | None = None

    def in_memory() -> Probe:
        nonlocal probe, stream
        if probe is None:
            if resident is not None:
                say("plan: this model's probe runs with the whole model in memory")
            stream, probe = None, Probe(model, [tokens], vocab)
        return probe

    if recipe is not None:
        settings = recipe_settings(recipe, tensors)
        budget, predicted = None, None
    else:
        n_params, n_bytes, n_arrays = _sizes(model)
        planned_bytes = sum(t.module.weight.nbytes for t in tensors)
        other = n_bytes - planned_bytes + 256 * n_arrays
        budget = (
            max_bytes - other if max_bytes is not None else budget_from_bpw(bpw, n_params, other)
        )
        check_fits(tensors, budget)  # before the measuring, which takes minutes
        if costs is None:
            try:
                if stream is None:
                    raise layerwise.Unsupported("in memory")
                stream.measure(tensors, means.get, progress=progress)
            except layerwise.Unsupported:
                p = in_memory()
                measure(tensors, means.get, lambda t, s: _kl_with(p, t, s), progress=progress)
        else:
            _reuse(tensors, costs)
        settings, floor = choose_with_head(tensors, budget)
        say(f"plan: head at {floor or 'any'} bits or more, {budget} bytes for the planned tensors")
        predicted = sum(t.cost(settings[t.path]) for t in tensors if t.fixed is None)
    measured = None
    if stream is not None:
        try:
            if stream.reference is None:  # a recipe, or reused costs: the reference alone
                stream.measure(tensors, None)
            measured = stream.measure_plan(tensors, settings)
        except layerwise.Unsupported:
            pass
    if measured is None:
        measured = _measure_plan(in_memory(), tensors, settings)
    return Plan(
        settings=settings,
        bytes=plan_bytes(tensors, settings),
        budget=budget,
        predicted_kl=predicted,
        measured_kl=measured,
        tokens=n_tokens,
        seconds=time.monotonic() - start,
        importance=means,
        sums=sums,
        counts=counts,
        costs={t.path: _costs_of(t) for t in tensors if t.errors},
        covariances=covariances,
    )


@functools.wraps(_plan_model)
def plan_model(model: nn.Module, *args: Any, **kwargs: Any) -> Plan:
    # The passes run with the backend's math (``backends.planning_layers``: on the CPU its
    # kernels for a prompt's attention, norms and activations, 2.4x MLX's ops a block).
    with backends.planning_layers(model):
        return _plan_model(model, *args, **kwargs)


def _sizes(model: nn.Module) -> tuple[int, int, int]:
    """Parameters, bytes and arrays of ``model`` (no array kept: a layer-by-layer plan's
    arrays must be dropped once a pass has put fresh lazy loads in their place)."""
    params = tree_flatten(model.parameters())
    return sum(v.size for _, v in params), sum(v.nbytes for _, v in params), len(params)


def _key(s: Setting) -> str:
    return f"{s.bits}:{s.group_size}"


def _costs_of(t: Tensor) -> dict:
    return {"alpha": t.alpha, "errors": {_key(s): e for s, e in t.errors.items()}}


def _reuse(tensors: Sequence[Tensor], costs: dict[str, dict]) -> None:
    """Set each tensor's measured figures from a saved plan; one line naming what is missing."""
    for t in tensors:
        if t.fixed is not None:
            continue
        saved = costs.get(t.path)
        try:
            t.alpha = float(saved["alpha"])  # type: ignore[index]
            t.errors = {s: float(saved["errors"][_key(s)]) for s in t.candidates}  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"--plan-from: expected measured costs for {t.path} at every setting, found "
                f"{'none' if saved is None else 'an incomplete entry'} (another model's plan?)"
            ) from None


def _kl_with(probe: Probe, t: Tensor, s: Setting) -> float:
    return probe.kl_with(t.module, fake_quantized(t.module.weight, s))


def _measure_plan(probe: Probe, tensors: Sequence[Tensor], settings: dict[str, Setting]) -> float:
    """KL on the probe tokens with every planned tensor quantized (min/max) at once."""
    originals = []
    try:
        for t in tensors:
            if t.path in settings:
                originals.append((t.module, t.module.weight))
                t.module.weight = fake_quantized(t.module.weight, settings[t.path])
        return probe.kl()
    finally:
        for m, w in originals:
            m.weight = w
        mx.eval([w for _, w in originals])
