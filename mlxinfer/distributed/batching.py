"""The batching engine across ranks: every rank's engine takes the same turns.

Each rank runs an :class:`~mlxinfer.batch.Engine` over its part of the model (a pipeline rank's
pool holds only its own layers' blocks), fed the same requests in the same order. An engine's
turn (admit, prefill chunks, one decode step) makes the model's forwards, and every forward is
a step all ranks must take with the same shapes; what a turn does depends on things that are
not the same on every rank: when each request was submitted, when its consumer cancelled it
(a stop string found, a caller gone), when the engine was closed. So rank 0 decides those and
the others follow (:meth:`Turns.agree`, one small collective a turn):

- how many waiting requests the turn takes (the others wait, within the rank timeout, for
  their own copies of them: same program, same prompts, same order);
- which running requests are cancelled (rank 0's consumers; the others' cancellations are
  ignored: theirs come at the same tokens, at other times);
- whether the engine closes (every rank's loop ends at the same turn).

The rest is the same on every rank by construction: the pools have the same number of blocks
(the fewest any rank's ``kv_budget`` buys: :meth:`Turns.equal_blocks`; a pipeline rank of
recurrent layers only has a pool of no bytes with as many blocks), the store is never
shrunk (a shrink on a timer forgets cached prefixes at different turns), requests without a
seed that sample get rank 0's seed plus their number. After admission the ranks compare what
each admitted (:meth:`Turns.check_admitted`: prompt, room, whether it fit, the prefix it
shares): a difference is a DistributedError on every rank, before any forward of other shapes.
Every model forward then compares its tokens with rank 0's and shares the last rank's logits
(pipeline.py), all under the watchdog.

With ``rank0_requests`` (``serve``: rank 0 owns the HTTP server) the requests are submitted on
rank 0 only: each turn rank 0 sends the others the requests it has not sent yet (prompt,
``max_tokens``, EOS tokens, how it drafts: :meth:`Turns.agree`, ``copies.py``), and after
each decode step the tokens rank 0 picked (:meth:`Turns.adopt`), or the drafts it kept and
the token after them (:meth:`Turns.adopt_kept`): its sampling, processors and constraints
run there alone. Prompt lookup drafts from the tokens only, so every rank drafts the same; a
draft model drafts on rank 0 alone, which sends each verification step's drafts
(:meth:`Turns.adopt_drafts`; the others' copies hold a :class:`~.copies.Rank0Drafts`). Rank
0 also turns at least every :data:`HEARTBEAT_S` seconds while idle (the others wait in the
turn's collective, within the rank timeout), and each turn's table carries every rank's
statistics (KV bytes, weight bytes, seconds computing and waiting) to rank 0's ``/metrics``.

A model with recurrent layers shares prefixes from snapshots of their states
(``batch/snapshots.py``), each rank's of its own layers (or channels, or heads). Every rank's
engine takes a recurrent model's turns, a pipeline rank without a recurrent layer too
(:meth:`Turns.any_recurrent`; its store keeps nothing and resumes anywhere); every rank's store
keeps as many snapshots, the fewest any rank's ``prefix_state_bytes`` buys
(:meth:`Turns.fewest_snapshots`), so the stores evict the same ones; at admission a request
resumes after the deepest snapshot every rank holds (:meth:`Turns.resume_point`).

The prefix cache on disk (``prefix_cache_dir``) keeps each rank's blocks of its own layers
(or heads), and its state snapshots, in files of its own (the rank's part is in the files'
fingerprint); at admission the ranks agree on the prefix blocks every rank's disk holds
(:meth:`Turns.fewest`), so that their pools take the same ones, and on the deepest snapshot
every rank holds in memory or on disk (:meth:`Turns.resume_point`).

A request drafting with a draft model, submitted on every rank (``batch_generate``), drafts on
rank 0 alone too (:meth:`Turns.follow_drafts`): the others take each step's drafts and what rank
0 kept of them (:meth:`Turns.adopt_kept`), since only rank 0 has the drafts' probabilities.
"""

from __future__ import annotations

import json
import math
import time
import zlib

import mlx.core as mx
import numpy as np

from ..batch.snapshots import MEMORY
from ..errors import DistributedError, MlxInferError
from .copies import drafting, mirror, model_drafting, take_rank0_drafts
from .group import Ranks

HEARTBEAT_S = 1.0  # with rank0_requests: rank 0 turns at least this often, idle or not
MAX_SENT_BYTES = 64 << 20  # the most request bytes rank 0 sends in one turn
NO_BYTES = 1 << 30  # the blocks a rank without attention layers buys (any number: the others')
ROW = ("closing", "waiting", "running", "cancelled", "new", "kv_kib", "weight_kib", "busy_ms")
ROW += ("wait_ms",)


class Turns:
    """One engine's agreement with its peers on the other ranks."""

    def __init__(self, ranks: Ranks, *, rank0_requests: bool = False) -> None:
        self.ranks = ranks
        self.rank0_requests = rank0_requests
        self.turn = 0
        self.submitted = 0
        self.last_turn = time.monotonic()
        # Every rank's row of the last turn's table (``ROW``): the per-rank statistics.
        self.table: np.ndarray | None = None
        # Requests that sample without a seed: rank 0's seed plus their number, everywhere.
        self.base_seed = ranks.shared_seed()

    shrink_every = math.inf  # the store keeps its size (see the module's docstring)
    rank0_requests = False
    cancels_here = False  # a request is cancelled when rank 0's is (agree), on every rank

    @property
    def close_s(self) -> float:
        """How long a closing engine waits for its thread: the last turn waits on the other
        ranks' (bounded by the watchdog)."""
        return self.ranks.watchdog.timeout + 5

    def equal_blocks(self, bytes_per_block: int, kv_budget: int) -> int:
        """The blocks every rank's pool has: the fewest any rank's ``kv_budget`` buys for its
        own layers (``bytes_per_block``). A pipeline rank of recurrent layers only (a block of
        no bytes) buys any number: its pool holds no bytes and keeps the others' count."""
        mine = min(kv_budget // bytes_per_block, NO_BYTES - 1) if bytes_per_block else NO_BYTES
        fewest = self._least([mine], "engine start: the pools' blocks")[0]
        if fewest == NO_BYTES:  # on every rank alike
            raise DistributedError(
                "batching across ranks: no rank holds an attention layer (recurrent layers "
                "only: no pool to size the blocks by)"
            )
        if fewest < 1:  # on every rank alike
            raise DistributedError(
                f"kv_budget: a rank's budget holds no block of its layers' keys and values "
                f"(this rank's block: {bytes_per_block} bytes)"
            )
        return fewest

    def any_recurrent(self, mine: bool) -> bool:
        """Whether any rank holds a recurrent layer: then every rank's engine takes the turns
        of a recurrent model (snapshot points cut its prefill chunks, one chunk a forward,
        states fed again after rejected drafts), a pipeline rank without one too."""
        out = self._least([int(not mine)], "engine start: recurrent layers")
        return not out[0]

    def fewest_snapshots(self, mine: int | None) -> int:
        """The fewest recurrent-state snapshots any rank's ``state_budget`` buys (``mine``:
        this rank's; None: a rank without states, which keeps none): every rank's store keeps
        as many, so that they evict the same ones."""
        mine = (1 << 30) if mine is None else min(mine, 1 << 30)
        return self._least([mine], "engine start: the state snapshots")[0]

    def resume_point(self, snapshots, hashes: list[bytes]) -> int:
        """How many of the blocks of ``hashes`` (the shared prefix: the same on every rank) a
        request resumes after: the deepest with a snapshot of the states after it that every
        rank holds, in memory or on disk (each rank's files are its own: one may lack a
        snapshot another holds). One collective; a second where a rank reads its snapshot from
        disk (a file found damaged there: the next deepest)."""
        held = np.array([snapshots.held(h) for h in hashes], np.int32)
        what = f"engine turn {self.turn}: the state snapshots on every rank"
        while len(held):
            common = np.array(self._least(held.tolist(), what))
            at = np.flatnonzero(common)
            if not len(at):
                return 0
            n = int(at[-1]) + 1
            if common[n - 1] == MEMORY:  # every rank's in memory
                return n
            if self._least([int(hashes[n - 1] in snapshots)], what)[0]:  # read back (disk)
                return n
            held[n - 1] = 0
        return 0

    def _least(self, values: list[int], what: str) -> list[int]:
        """The smallest of each of ``values`` over the ranks."""
        out = mx.distributed.all_min(mx.array(values, dtype=mx.int32), group=self.ranks.group)
        self.ranks.run(what, out)
        return out.tolist()

    def follow_drafts(self, request, draft, num_draft: int | None, max_draft: int) -> bool:
        """On a rank other than 0, for a request submitted here drafting with a draft model:
        make it take rank 0's drafts (:class:`~.copies.Rank0Drafts`; rank 0 alone runs the
        draft model, and sends each step's drafts and what it kept of them) and say so; else
        False (the engine starts the drafting itself: prompt lookup drafts from the tokens
        alone, the same on every rank)."""
        if self.ranks.first or getattr(draft, "model", None) is None:
            return False
        if num_draft is not None and not 1 <= num_draft <= max_draft:
            raise ValueError(f"num_draft must be in 1..{max_draft} (max_draft), got {num_draft}")
        take_rank0_drafts(request, num_draft)
        return True

    def seeded(self, sampling):
        """``sampling`` with a seed the same on every rank (a request that samples without one
        gets rank 0's seed plus its number)."""
        number = self.submitted
        self.submitted += 1
        if sampling.greedy or sampling.seed is not None:
            return sampling
        from dataclasses import replace

        return replace(sampling, seed=(self.base_seed + number) % (1 << 31))

    def agree(self, engine, waiting: list) -> list | None:
        """Rank 0's decisions for this turn, applied: rank 0's cancelled requests retired on
        every rank; the turn's waiting requests (this rank's copies of the ones rank 0
        takes; the rest stay queued), or None when rank 0 closed the engine."""
        self.turn += 1
        self.last_turn = time.monotonic()
        ranks, running = self.ranks, engine._running
        what = f"engine turn {self.turn}"
        cancelled = [int(r.cancelled.is_set()) for r in running]
        fresh = [r for r in waiting if not getattr(r, "sent", False)] if ranks.first else []
        row = [int(engine._closed), len(waiting), len(running), sum(cancelled), len(fresh)]
        row += self._statistics(engine)
        table = mx.zeros((ranks.size, len(row)), dtype=mx.int32)
        table[ranks.rank] = mx.array(row, dtype=mx.int32)
        table = ranks.all_sum(table)
        ranks.run(f"{what}: rank 0's decisions", table)
        self.table = table = np.array(table)
        closing, take, n_running, n_cancelled, n_new = (int(v) for v in table[0, :5])
        if (table[:, 2] != n_running).any():
            bad = int(np.flatnonzero(table[:, 2] != n_running)[0])
            raise DistributedError(
                f"rank {bad} runs {int(table[bad, 2])} requests at {what}, rank 0 {n_running} "
                f"(seen by rank {ranks.rank}): the ranks' engines were fed differently"
            )
        if n_cancelled:
            flags = ranks.broadcast(mx.array(cancelled, dtype=mx.int32), f"{what}: cancellations")
            for request, flag in zip(list(running), flags.tolist()):
                if flag:  # a request in a flight at its landing (batch/flights.py)
                    engine._cancel(request)
        if self.rank0_requests and not closing:
            waiting = self._sent(engine, waiting, fresh, take - n_new, n_new, what)
        elif len(waiting) < take and not closing:
            waiting = waiting + self._more(engine, take - len(waiting), what)
        if closing or len(waiting) > take:  # the rest stays queued, in order
            keep = 0 if closing else take
            with engine._cond:
                engine._waiting[:0] = waiting[keep:]
            waiting = waiting[:keep]
        return None if closing else waiting

    def fewest(self, n: int) -> int:
        """The smallest ``n`` of every rank's (the prefix blocks each rank's disk tier holds,
        or read: each rank's files are its own)."""
        out = mx.distributed.all_min(mx.array(n, dtype=mx.int32), group=self.ranks.group)
        self.ranks.run(f"engine turn {self.turn}: the prefix blocks on every rank's disk", out)
        return int(out.item())

    def due(self) -> bool:
        """Whether the engine's idle loop must turn now: with ``rank0_requests`` a rank other
        than 0 always (it waits in the turn's collective for rank 0's), rank 0 every
        :data:`HEARTBEAT_S` seconds (the others' wait stays within the rank timeout, and a
        rank lost while idle shows at once)."""
        if not self.rank0_requests:
            return False
        return not self.ranks.first or time.monotonic() - self.last_turn >= HEARTBEAT_S

    def adopt(self, picked: mx.array) -> mx.array:
        """With ``rank0_requests``: the tokens rank 0 picked for the step's rows, on every
        rank (its sampling, processors and constraints ran there alone)."""
        if not self.rank0_requests:
            return picked
        return self.ranks.broadcast(picked, f"engine turn {self.turn}: rank 0's tokens")

    def adopt_kept(
        self, rows: list, kept: list[int], tokens: list[int]
    ) -> tuple[list[int], list[int]]:
        """With ``rank0_requests``, or rows drafting with rank 0's draft model (whose drafts'
        probabilities rank 0 alone has): how many drafts rank 0 kept of each row's, and the
        token after them (its acceptance sampled there alone), on every rank."""
        if not self.rank0_requests and not model_drafting(rows):
            return kept, tokens
        pairs = mx.array([kept, tokens], dtype=mx.int32)
        pairs = self.ranks.broadcast(pairs, f"engine turn {self.turn}: rank 0's drafts kept")
        kept, tokens = pairs.tolist()
        return kept, tokens

    def adopt_drafts(self, rows: list, proposals: list) -> list:
        """The drafts of the rows that draft with rank 0's draft model, sent by rank 0 (the
        others' copies hold a :class:`~.copies.Rank0Drafts`, which proposes none). Which rows
        those are is the same on every rank; none: no collective."""
        from ..batch.rows import Proposal

        rows_drafting = model_drafting(rows)
        if not rows_drafting:
            return proposals
        width = 1 + max(len(proposals[b].tokens) for b in rows_drafting) if self.ranks.first else 0
        width = int(self.ranks.broadcast(mx.array(width, mx.int32), f"engine turn {self.turn}"))
        table = np.zeros((len(rows_drafting), width), np.int32)
        if self.ranks.first:
            for i, b in enumerate(rows_drafting):
                tokens = proposals[b].tokens
                table[i, 0] = len(tokens)
                table[i, 1 : 1 + len(tokens)] = tokens
        table = self.ranks.broadcast(mx.array(table), f"engine turn {self.turn}: rank 0's drafts")
        if self.ranks.first:
            return proposals
        out = list(proposals)
        for i, b in enumerate(rows_drafting):
            row = table[i].tolist()
            out[b] = Proposal(row[1 : 1 + row[0]], None)
        return out

    def _sent(self, engine, waiting: list, fresh: list, held: int, n_new: int, what: str):
        """With ``rank0_requests``: the turn's waiting requests, rank 0's new ones sent to the
        others (which build theirs from them, after the ones they hold as rank 0 does)."""
        ranks = self.ranks
        if len(waiting) != held + (n_new if ranks.first else 0):
            raise DistributedError(
                f"rank {ranks.rank} holds {len(waiting) - (n_new if ranks.first else 0)} "
                f"waiting requests at {what}, rank 0 {held}: the ranks' engines part ways"
            )
        if not n_new:
            return waiting
        data = b""
        if ranks.first:
            described = [
                {"ids": r.ids, "max_tokens": r.max_tokens, "eos": sorted(r.eos), **drafting(r)}
                for r in fresh
            ]
            data = json.dumps(described, separators=(",", ":")).encode()
            for r in fresh:
                r.sent = True
        size = int(ranks.broadcast(mx.array(len(data), dtype=mx.int32), f"{what}: requests"))
        if not 0 < size <= MAX_SENT_BYTES:
            raise DistributedError(
                f"{what}: rank 0's new requests take {size} bytes, expected 1..{MAX_SENT_BYTES}"
            )
        raw = np.frombuffer(data, np.uint8) if ranks.first else np.zeros(size, np.uint8)
        raw = ranks.broadcast(mx.array(raw), f"{what}: requests")
        if ranks.first:
            return waiting
        try:
            described = json.loads(bytes(np.array(raw)))
            made = [
                mirror(engine, d["ids"], d["max_tokens"], d["eos"], d.get("lookup"), d.get("rank0"))
                for d in described
            ]
        except (ValueError, KeyError, TypeError, MlxInferError) as e:
            raise DistributedError(f"{what}: rank 0's requests do not read ({e})") from None
        if len(made) != n_new:
            raise DistributedError(f"{what}: rank 0 sent {len(made)} requests, expected {n_new}")
        return waiting + made

    def _statistics(self, engine) -> list[int]:
        """This rank's statistics for the turn's table (``ROW``'s last four: KiB, ms)."""
        ranks = self.ranks
        kv = engine.pool.nbytes + (engine.window_pool.nbytes if engine.window_pool else 0)
        cap = (1 << 31) - 1
        return [
            min(kv >> 10, cap),
            min(ranks.weight_bytes >> 10, cap),
            min(int(ranks.seconds["computing"] * 1000), cap),
            min(int(ranks.seconds["waiting"] * 1000), cap),
        ]

    def rank_metrics(self) -> dict[int, dict[str, float]]:
        """Every rank's statistics as of the last turn (rank 0's ``/metrics``)."""
        if self.table is None:
            return {}
        out = {}
        for r, row in enumerate(self.table):
            values = dict(zip(ROW, (int(v) for v in row)))
            out[r] = {
                "kv_bytes": values["kv_kib"] << 10,
                "weight_bytes": values["weight_kib"] << 10,
                "computing_seconds": values["busy_ms"] / 1000,
                "waiting_seconds": values["wait_ms"] / 1000,
            }
        return out

    def _more(self, engine, n: int, what: str) -> list:
        """The next ``n`` requests submitted on this rank (rank 0's turn takes them), waited
        for within the rank timeout."""
        deadline = time.monotonic() + ranks_timeout(self.ranks)
        with engine._cond:
            while len(engine._waiting) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DistributedError(
                        f"rank {self.ranks.rank}: {what}: rank 0 took {n} more request(s) than "
                        f"were submitted here within the rank timeout "
                        f"({ranks_timeout(self.ranks):g} s): every rank must submit the same "
                        "requests in the same order"
                    )
                engine._cond.wait(min(left, 0.05))
            more, engine._waiting[:n] = engine._waiting[:n], []
        return more

    def admitted(self, engine, requests: list) -> None:
        """After admission (``batch/turns.py``'s interface): :meth:`check_admitted`."""
        self.check_admitted(requests)

    def check_admitted(self, requests: list) -> None:
        """The ranks compare what this turn admitted: each request's prompt (length and a
        checksum), its room, whether it was admitted, and the prefix tokens it shares."""
        if not requests:
            return
        rows = [
            [
                len(r.ids),
                zlib.crc32(np.asarray(r.ids, np.int64).tobytes()) & 0x7FFFFFFF,
                r.max_tokens,
                int(r.seq is not None),
                r.cached_tokens if r.seq is not None else -1,
            ]
            for r in requests
        ]
        self.ranks.check_same(
            mx.array(rows, dtype=mx.int32),
            f"engine turn {self.turn}",
            why="requests (prompt, max_tokens, admission or shared prefix) other than rank 0's: "
            "every rank must submit the same requests in the same order",
        )


def ranks_timeout(ranks: Ranks) -> float:
    return ranks.watchdog.timeout
