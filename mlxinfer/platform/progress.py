"""Progress of long steps (loading, converting), reported to a callback.

A callback takes ``(stage, done, total)``: ``stage`` names the step (``"reading weights"``,
``"writing weights"``, ``"importing tensors"``, a quantization plan's ``"calibration"`` and
``"measuring tensors"``), ``done`` and ``total`` count its unit (bytes; calibration blocks, each
run on every calibration sequence, or the in-memory ``calibrate``'s sequences; tensors).
``done`` never decreases within a stage and the stage's last call has ``done == total``.
Callbacks run on the thread doing the work: an app hands the numbers to its UI thread itself
(Qt: a signal; asyncio: ``loop.call_soon_threadsafe``).

The command line's progress bars are one such callback (:class:`Bars`).
"""

from __future__ import annotations

from typing import Callable

Progress = Callable[[str, int, int], None]


def quiet(stage: str, done: int, total: int) -> None:
    pass


class Bars:
    """A tqdm bar per stage, on stderr."""

    def __init__(self) -> None:
        self.bars: dict = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        from tqdm import tqdm

        bar = self.bars.get(stage)
        if bar is None:
            bar = self.bars[stage] = tqdm(
                total=total,
                desc=stage,
                unit="B" if "weights" in stage else "block" if stage == "calibration" else "tensor",
                unit_scale=True,
                leave=False,
            )
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    def close(self) -> None:
        """Clear the bars still open (the step failed before its end)."""
        for bar in self.bars.values():
            bar.close()

    def __enter__(self) -> Bars:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve(progress: bool | Progress | None) -> Progress:
    """A callback from a ``progress`` option: True: the bars; a callable: itself; else quiet."""
    if callable(progress):
        return progress
    return Bars() if progress else quiet


def counted(items, stage: str, progress: Progress):
    """``items`` (a sized iterable), reporting ``(stage, items done, total)`` as they go."""
    total = len(items)
    progress(stage, 0, total)
    for i, item in enumerate(items, start=1):
        yield item
        progress(stage, i, total)


def finished(progress: Progress) -> None:
    """Close what ``progress`` shows, if anything (call it however the step ended)."""
    close = getattr(progress, "close", None)
    if close is not None:
        close()
