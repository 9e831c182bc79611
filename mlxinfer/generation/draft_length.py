"""How many tokens to draft next: chosen from measured costs and the running acceptance, so that
speculative decoding is never slower than plain decoding (k = 0 is plain decoding).

A step that drafts k tokens costs ``cost(k) = verify(k + 1) + k * draft`` (the target's forward
over k + 1 positions, and k draft tokens) and emits, on average,

    E(k) = sum_{i=0..k} prod_{j<i} a_j        (E(0) = 1: plain decoding)

tokens, with a_j the probability that the draft at position j is accepted given that those
before it were. The policy drafts ``argmax_k E(k) / cost(k)`` over 0 … ``MAX_DRAFT``: tokens per
second. Both sides are measured as the loop runs, never assumed:

- a_j: decayed counts of the accept/reject decisions at position j (a position is decided
  when every draft before it passed), starting from a prior's pseudo-counts that decay with
  them, so a change in acceptance moves k within a few steps. A position not yet tried reads the deepest tried one.
  The prior is what the earlier requests on the same costs saw (``StepCosts.prior``: slowly
  decayed counts), ``PRIOR`` for the first.
- verify(L): an exponential moving average of the timed steps that fed L positions; an L not
  timed yet is read off a least-squares line through those timed (flat while only one is:
  trying a longer draft is how its cost gets measured). ``draft``: a moving average of the
  draft time per drafted token.

A seeded sampling request is the exception: the tokens it draws depend on the k of each step,
so to draw the same tokens on every run (and alone or in a batch) its k must not depend on
timings. It reads :func:`nominal_costs` instead (verifying any length costs 1, a draft token
0.1), which depend on its acceptance alone. Greedy output does not depend on k at all.

The first step that drafts on costs with no draft timed drafts one token (the cheapest step
that times a draft and a two-position verification). Past the longest verification timed, its
cost is the line's guess: where the best k verifies that longest length, the verifications
timed are nearly flat (``EXPLORE_FLAT``: a GPU's) and the next draft would more likely pass than
not, k goes one further, which times it; a steep line (a CPU's) is trusted.

In the batching engine a row's step is every row's: drafting k makes the whole batch verify k + 1
positions, so a row weighs ``(B - 1 + E(k)) / cost(k)`` against ``B / cost(0)`` for B rows, the
others counted at one token each (the step's cost is per row-token drafted plus the verification:
where the verification is flat this is also the rule for every row drafting alike).

When drafting does not pay (k = 0), a probe step drafts every ``probe`` steps to refresh the
acceptance; the interval doubles (up to ``MAX_PROBE``) while probes keep showing it does not,
and the next request on the same costs starts from the interval reached. Where not even drafts
that always pass would pay at the measured costs, the interval is ``MAX_PROBE`` at once: a probe
could only refresh the costs.
The steps in between are plain decoding, and the speculative loop runs them as such
(``speculative._plain_run``: pipelined like ``generate_step``, no drafting bookkeeping):
:meth:`DraftLength.plain_steps` says how many, :meth:`DraftLength.ran_plain` records them. So
that drafting is weighed against plain decoding as it really runs, a timed request whose
model has no plain step timed yet decodes ``MEASURE_PLAIN`` tokens plainly first
(``measure_plain``; the batching engine's rows, whose steps are shared, do not).
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter

MAX_DRAFT = 16  # the ceiling: verifying more positions stops being free even on a GPU
PRIOR = 0.75  # acceptance assumed before samples (k = 4 when verifying is free)
PRIOR_WEIGHT = 2.0  # … worth this many decisions, decaying as they do
DECAY = 0.7  # weight of a decision one step older: acceptance comes in bursts
SHARED_DECAY = 0.98  # … in the acceptance shared by the requests on the same costs
COST_WEIGHT = 0.3  # weight of the newest timing in the moving averages
MIN_PROBE, MAX_PROBE = 8, 256  # steps between probes while drafting is off
MEASURE_PLAIN = 4  # plain steps timed first, when the model has none timed
# The next draft position's acceptance from which k goes one past the longest verification timed
# (its cost read off the line until then): a longer draft is tried, and timed, only where it
# would more likely than not be kept.
EXPLORE_ABOVE = 0.5
# ... and only where the verifications timed are nearly flat (the longest within this factor of
# one position's): a GPU's, whose cost stays flat and then rises, so the line cannot tell where.
# A CPU's grows with the positions from the first (8 rows: two positions cost ~2x one), and
# its line is trusted: an 8-row batch that drafted past it on one lucky acceptance cost a step
# of ~5 plain ones.
EXPLORE_FLAT = 1.25


class StepCosts:
    """Measured step costs of one model on one backend (at one batch size): seconds to verify L
    positions, by L, and seconds per drafted token. Shared by the requests it serves."""

    def __init__(self) -> None:
        self.verify: dict[int, float] = {}  # L -> seconds (moving average)
        self.draft: float | None = None  # seconds per drafted token (moving average)
        self._line: tuple[float, float, float, float] | None = None  # verify_s's fit, cached
        # The acceptance the requests drafting on these costs saw, by position: (accepted,
        # decided), slowly decayed. A new request starts from it (its prior) rather than from
        # PRIOR, so the second request of a draft that rarely passes does not learn it again.
        self.accepted: list[float] = []
        self.decided: list[float] = []
        # The probe interval the last request on these costs reached: the next starts there,
        # so a draft that does not pay is not probed from MIN_PROBE again by every request.
        self.probe = MIN_PROBE
        # A request has claimed this step's drafting to time a draft (no draft timed yet): in a
        # batch one row times it, the others wait a step; :meth:`record` ends the step.
        self.timing_claimed = False

    def seen(self, j: int, passed: bool) -> None:
        """A draft at position ``j`` was decided (``passed``)."""
        while len(self.decided) <= j:
            self.accepted.append(0.0)
            self.decided.append(0.0)
        self.accepted[j] = SHARED_DECAY * self.accepted[j] + passed
        self.decided[j] = SHARED_DECAY * self.decided[j] + 1

    def prior(self, j: int) -> float:
        """The acceptance a new request assumes at position ``j`` (PRIOR before any was seen;
        a position not seen yet reads the deepest seen)."""
        if not self.decided:
            return PRIOR
        j = min(j, len(self.decided) - 1)
        return self.accepted[j] / self.decided[j]

    def record(self, k: int, draft_s: float, positions: int, verify_s: float) -> None:
        """A step that drafted for ``k`` tokens in ``draft_s`` and verified ``positions`` in
        ``verify_s`` (seconds)."""
        self.verify[positions] = _average(self.verify.get(positions), verify_s)
        self._line = None
        self.timing_claimed = False
        if k > 0:
            self.draft = _average(self.draft, draft_s / k)

    def verify_s(self, positions: int) -> float | None:
        """Seconds to verify ``positions``: timed, else on the line through those timed."""
        if positions in self.verify:
            return self.verify[positions]
        if not self.verify:
            return None
        if self._line is None:  # (mean x, mean y, slope >= 0, least y): refit after a record
            xs, ys = list(self.verify), list(self.verify.values())
            mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
            spread = sum((x - mx_) ** 2 for x in xs)
            slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / spread if spread else 0.0
            self._line = (mx_, my, max(slope, 0.0), min(ys))
        mx_, my, slope, least = self._line
        return max(my + slope * (positions - mx_), least)

    def cost(self, k: int) -> float | None:
        """Seconds for a step drafting ``k``; None before any step was timed."""
        verify = self.verify_s(k + 1)
        if verify is None:
            return None
        return verify + k * (self.draft or 0.0)


def nominal_costs() -> StepCosts:
    """Fixed costs for a request whose k must not depend on timings (seeded sampling): a
    verification of any length costs 1, a drafted token 0.1."""
    costs = StepCosts()
    costs.verify[1], costs.draft = 1.0, 0.1
    costs.record = lambda *args: None  # type: ignore[method-assign]  # never measured
    return costs


def timed(params) -> bool:
    """Whether a request with sampling ``params`` may choose k from timings (not seeded
    sampling: module docstring)."""
    return params.greedy or params.seed is None


class DraftLength:
    """One request's k: fixed when ``fixed`` is given, else chosen from ``costs`` (shared; a
    fresh one when None) and this request's acceptance (module docstring). ``measure_plain``:
    the caller runs k = 0 as plain decoding (:meth:`plain_steps`), timed before drafting."""

    def __init__(
        self, fixed: int | None, costs: StepCosts | None = None, *, measure_plain: bool = False
    ):
        self.fixed = fixed
        self.measure_plain = measure_plain  # the caller runs k = 0 as plain decoding: time it
        # Whether a due probe may run this step (None: always). The batch engine's rows probe
        # on the same steps: one row's probe makes the whole step verify two positions.
        self.probe_now: Callable[[], bool] | None = None
        self.costs = costs if costs is not None else StepCosts()
        # Rows in the batching engine's step (1 alone): the others' tokens count in the step's
        # yield, one each, since the step's longer verification is theirs to pay too.
        self.batch = 1
        self.passed: list[float] = []  # decayed accepts at position j
        self.decided: list[float] = []  # decayed decisions at position j
        self.off_for = 0  # steps since drafting went off (k = 0)
        self.probe = self.costs.probe
        self.best = 4  # the best k > 0 (a probe drafts that many)
        self._k: int | None = None
        self._t = 0.0

    def acceptance(self, j: int) -> float:
        """a_j: the estimated chance that the draft at position j passes when those before did."""
        if not self.decided:
            return self.costs.prior(j)
        j = min(j, len(self.decided) - 1)
        return self.passed[j] / self.decided[j]

    def expected(self, k: int) -> float:
        """E(k): expected tokens from a step that drafts k."""
        total, reach = 1.0, 1.0
        for j in range(k):
            reach *= self.acceptance(j)
            total += reach
        return total

    @property
    def k(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self._k is None:
            self._k = self._choose()
        return self._k

    def _choose(self) -> int:
        if self.measure_plain and 1 not in self.costs.verify:
            return 0  # plain decoding's cost first: what drafting must beat
        if self.measure_plain and self.costs.draft is None:
            # then one drafting step to time a draft: one token, the cheapest that measures a
            # draft and a longer verification (the prior's best k, 4, verified 5 positions: on
            # a CPU a 5-position pass of an 8-row batch cost ~5 plain steps, for a head that
            # was then turned off); longer drafts are timed as k grows to them (below). In a
            # batch one row drafts it (the others' drafts would add their cost, not a timing).
            if self.costs.timing_claimed:
                return 0
            self.costs.timing_claimed = True
            return 1
        rates, ceiling = {}, 0.0
        expected, reach = 1.0, 1.0  # E(k), built up as k grows (expected(k) for each is O(k^2))
        others = self.batch - 1  # a batch's other rows: a token each (module docstring)
        for k in range(MAX_DRAFT + 1):
            cost = self.costs.cost(k)
            if cost is None:  # nothing timed yet: draft the best k for the prior, to measure it
                return self.best
            if k:
                reach *= self.acceptance(k - 1)
                expected += reach
                ceiling = max(ceiling, (others + k + 1) / max(cost, 1e-12))  # every draft kept
            rates[k] = (others + expected) / max(cost, 1e-12)
        drafting = max(range(1, MAX_DRAFT + 1), key=lambda k: rates[k])
        if rates[drafting] > rates[0]:
            longest = max(self.costs.verify)
            if (
                drafting + 1 == longest
                and drafting < MAX_DRAFT
                and self.acceptance(drafting) >= EXPLORE_ABOVE
                and self.costs.verify[longest] <= EXPLORE_FLAT * (self.costs.verify_s(1) or 0.0)
            ):
                # the best k verifies the longest length timed; one more is only the line's
                # guess (a GPU's verification is flat, then rises): try it, which times it
                drafting += 1
            self.best = drafting
            self.off_for, self.probe = 0, MIN_PROBE
            self.costs.probe = MIN_PROBE
            return drafting
        self.best = drafting
        if ceiling <= rates[0] and self.probe < MAX_PROBE:
            # Not even drafts that always pass would pay at these costs (a CPU verifying
            # several rows' drafts): a probe could find no acceptance worth it, only refresh
            # the costs, so it waits the longest interval (each probe is a drafting step).
            self.probe = MAX_PROBE
            self.costs.probe = MAX_PROBE
        self.off_for += 1
        if self.off_for >= self.probe and (self.probe_now is None or self.probe_now()):
            # a probe: refresh the first position's acceptance (one
            # draft, the cheapest step that does), then wait longer; k grows again if it passes
            self.off_for, self.probe = 0, min(2 * self.probe, MAX_PROBE)
            self.costs.probe = self.probe
            return 1
        return 0

    def changed(self) -> None:
        """The costs (or what k reads) changed: k is chosen again when next read."""
        self._k = None

    def plain_steps(self) -> int:
        """While k is 0: how many plain steps to run before k is chosen again (the next probe,
        or ``MEASURE_PLAIN`` while plain decoding is not timed yet)."""
        if 1 not in self.costs.verify:
            return MEASURE_PLAIN
        return max(1, self.probe - self.off_for)

    def ran_plain(self, steps: int) -> float:
        """``steps`` plain steps ran since :meth:`start`: their seconds, recorded as the cost
        of verifying one position (a plain step), and the steps counted toward the probe."""
        elapsed = perf_counter() - self._t
        if steps > 0:
            self.costs.record(0, 0.0, 1, elapsed / steps)
        if self.off_for:  # k = 0 was chosen (not the first measurement): count the steps
            self.off_for = min(self.off_for + steps - 1, max(self.probe - 1, 0))
        self._k = None
        return elapsed

    def update(self, accepted: int, proposed: int) -> None:
        """A step proposed ``proposed`` drafts and the target kept ``accepted`` of them."""
        for j in range(proposed):
            if j > accepted:  # the first rejection ended the step: later ones were not decided
                break
            while len(self.decided) <= j:  # the prior's pseudo-decisions, decaying with the rest
                self.passed.append(self.costs.prior(len(self.decided)) * PRIOR_WEIGHT)
                self.decided.append(PRIOR_WEIGHT)
            self.passed[j] = DECAY * self.passed[j] + (j < accepted)
            self.decided[j] = DECAY * self.decided[j] + 1
            self.costs.seen(j, j < accepted)
        self._k = None

    # The loop times its steps through these (``perf_counter``: tests put a fake clock there).
    def start(self) -> None:
        """The step begins: it drafts now."""
        self._t = perf_counter()

    def drafted(self) -> float:
        """The drafts are evaluated: the seconds they took; verification begins."""
        now = perf_counter()
        elapsed, self._t = now - self._t, now
        return elapsed

    def verified(self, k: int, draft_s: float, positions: int) -> float:
        """The step's verification of ``positions`` is done (rewind included): its seconds,
        recorded with the draft's."""
        verify_s = perf_counter() - self._t
        self.costs.record(k, draft_s, positions, verify_s)
        self._k = None
        return verify_s


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + COST_WEIGHT * (new - old)
