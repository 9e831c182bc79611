"""What generation hands back: the per-token results, the request's timeline, and the
token loops' steps. A leaf module: the loops (loop.py, speculative.py) and
everything that reads their output import it, and it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx


class Step(NamedTuple):
    """One token from a token loop, with what the loop did to produce it.

    The speculative loop reports its counts here: on the first token of each
    target forward pass, ``passes`` is 1 and ``drafted`` / ``accepted`` are that
    pass's draft tokens proposed and kept; on the other tokens they are 0.
    """

    token: int
    logprobs: (
        mx.array
    )  # (V,) log-probs the token was drawn from (after processors, before filtering)
    from_draft: bool = False  # proposed by the draft and accepted
    passes: int = 1  # target forward passes that started with this token
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0  # seconds the pass's drafts took
    verify_s: float = 0.0  # seconds its verification took (the forward, acceptance, rewind)


@dataclass
class GenerationStats:
    """One request's timeline: tokenize → prefill → first token → decode."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a reused PromptCache
    generation_tokens: int = 0
    tokenize_ms: float = 0.0
    prefill_tps: float = 0.0
    time_to_first_token_s: float = 0.0
    decode_tps: float = 0.0
    peak_memory_gb: float = 0.0
    # speculative decoding (zero without a draft)
    draft_tokens: int = 0  # proposed by the draft
    accepted_tokens: int = 0  # of those, accepted by the target
    speculative_steps: int = 0  # target forward passes while decoding
    # By draft position j (0: the first draft of a step): drafts proposed there, and accepted.
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_ms: float = 0.0  # time spent drafting, all steps
    verify_ms: float = 0.0  # time spent verifying (target forwards, acceptance, rewinds)
    # What cut the generation short of max_tokens, when something did: "kv_budget" (the
    # request's KV cache reached its budget: memory.kv_limit), else "".
    limited_by: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per target forward pass (1.0 for plain decoding)."""
        return self.generation_tokens / self.speculative_steps if self.speculative_steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Of the drafts at each position of a step, the share accepted (position 0 first)."""
        return [
            a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)
        ]

    @property
    def draft_ms_per_step(self) -> float:
        return self.draft_ms / self.speculative_steps if self.speculative_steps else 0.0

    @property
    def verify_ms_per_step(self) -> float:
        return self.verify_ms / self.speculative_steps if self.speculative_steps else 0.0

    def count(self, step: Step) -> None:
        """Add one step's speculative counts (plain decoding: one pass per token)."""
        self.speculative_steps += step.passes
        self.draft_tokens += step.drafted
        self.accepted_tokens += step.accepted
        self.draft_ms += step.draft_s * 1000
        self.verify_ms += step.verify_s * 1000
        if step.drafted > len(self.drafted_by_position):
            grow = step.drafted - len(self.drafted_by_position)
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for j in range(step.drafted):
            self.drafted_by_position[j] += 1
            self.accepted_by_position[j] += j < step.accepted

    def table(self) -> str:
        rows = [
            ("prompt tokens", f"{self.prompt_tokens} ({self.cached_tokens} cached)"),
            ("tokenize", f"{self.tokenize_ms:.1f} ms"),
            ("prefill", f"{self.prefill_tps:.1f} tok/s"),
            ("time to first token", f"{self.time_to_first_token_s * 1000:.1f} ms"),
            ("generated tokens", f"{self.generation_tokens}"),
            ("decode", f"{self.decode_tps:.1f} tok/s"),
            ("peak memory", f"{self.peak_memory_gb:.3f} GB"),
        ]
        if self.limited_by:
            rows.append(("stopped by", self.limited_by))
        if self.speculative_steps:
            accepted = f"{self.accepted_tokens}/{self.draft_tokens} ({self.acceptance_rate:.0%})"
            by_position = " ".join(f"{a:.0%}" for a in self.acceptance_by_position[:8])
            ms = f"{self.draft_ms_per_step:.1f} / {self.verify_ms_per_step:.1f} ms"
            rows[-1:-1] = [
                ("draft accepted", accepted),
                ("  by position", by_position or "-"),
                ("tokens per step", f"{self.tokens_per_step:.2f}"),
                ("draft / verify", ms),
            ]
        return "\n".join(f"{k:<20} {v:>14}" for k, v in rows)


@dataclass
class GenerationResult:
    """One generated token and the text it completes."""

    text: str  # new text segment: may be "" (a partial character or a held-back stop prefix)
    token: int
    logprobs: mx.array | None = None  # (V,) log-probs the token was drawn from (before filtering)
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or None while running
    from_draft: bool = False  # speculative decoding: proposed by the draft and accepted
    stats: GenerationStats = field(default_factory=GenerationStats)
    # On the last result: the stop string that ended the output (not part of ``text``), or None
    # (EOS, the length, or no stop strings).
    stop_string: str | None = None
    # With tools: on the last result, the calls parsed from the whole output (a list of
    # ``toolcalls.ToolCall``, empty when it made none); None without tools. A call's text is
    # held back from ``text`` (released on the last result if it did not parse as a call).
    tool_calls: list | None = None
    # With tools: a call has begun by this token (its text is being held back).
    in_tool_call: bool = False
    # With split_reasoning: this token's part of the model's reasoning (``text`` is then only
    # the answer's part); "" otherwise (reasoning.py)
    reasoning: str = ""
