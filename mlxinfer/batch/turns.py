"""One process's turns: what the scheduler asks of its peers, answered alone.

Across ranks every rank's engine takes the same turns, decided by rank 0
(``mlxinfer.distributed.batching.Turns``). :class:`LocalTurns` has the same interface for one
process, each method the identity or the one-process rule, so the scheduler calls the turns
unconditionally and reads the same either way.
"""

from __future__ import annotations

from ..generation.sampling import SamplingParams


class LocalTurns:
    """The turns of an engine with no peers."""

    cancels_here = True  # a request cancelled here is dropped here (across ranks: rank 0's)
    alone = True  # no peer: a drafting row's k may follow this process's timings
    close_s = 0.0  # no peer's last turn to wait for at close

    def due(self) -> bool:
        """Never: an idle engine alone waits for requests, not for a heartbeat."""
        return False

    def agree(self, engine, waiting: list) -> list | None:
        """The turn's waiting requests, or None (handing them back) once the engine closed."""
        if engine._closed:
            with engine._cond:
                engine._waiting[:0] = waiting
            return None
        return waiting

    def admitted(self, engine, requests: list) -> None:
        """After admission: the running requests cancelled since the last turn retire."""
        engine._retire_cancelled()

    def seeded(self, sampling: SamplingParams) -> SamplingParams:
        return sampling

    def follow_drafts(self, request, draft, num_draft: int | None, max_draft: int) -> bool:
        """False: this engine starts every request's drafting itself."""
        return False

    def fewest(self, n: int) -> int:
        return n

    def resume_point(self, snapshots, hashes: list[bytes]) -> int:
        """The most of the blocks of ``hashes`` after which ``snapshots`` keeps one (0: none)."""
        return next((n for n in range(len(hashes), 0, -1) if hashes[n - 1] in snapshots), 0)

    def rank_metrics(self) -> dict[int, dict[str, float]]:
        """No ranks, so no per-rank lines in ``/metrics``."""
        return {}

    def adopt(self, picked):
        return picked

    def adopt_drafts(self, rows: list, proposals: list) -> list:
        return proposals

    def adopt_kept(self, rows: list, kept: list[int], tokens: list[int]):
        return kept, tokens
