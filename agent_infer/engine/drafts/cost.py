"""What steps and drafts cost, measured online, and how long a draft pays to be.

A step feeding ``R`` rows takes about ``T(R) = a + b·pad(R)`` seconds: ``a`` is what every step
pays once, ``b`` one more row, and ``pad`` rounds up to the model's row multiple (the torch CPU path
runs every matmul on chunks of 4 rows, so the 2nd to 4th row of a chunk cost nothing more). In a
batch of ``B`` requests, a draft of ``n`` tokens whose first ``i`` are kept with chance ``S_i``
(:mod:`.survival`) adds ``E(n) = sum_{i <= n} S_i`` tokens to the step's output, and costs the whole
batch its rows, ``T(R + n) - T(R)``, plus what its source spends proposing it, ``c(n)``. The batch's
tokens per second rise when ``(B + E) / (T + Δ) > B / T``, i.e. when the draft's *net gain*
``E(n) - B·(T(R + n) - T(R) + c(n)) / T(R)`` is positive. A request drafts from the source whose
best length has the largest positive gain, at that length; none when no gain is positive.

Every estimate is exponentially weighted (weight :data:`DECAY` per observation), so it follows the
machine's load and the batch as they change:

* ``a`` and ``b``: a weighted least-squares line through recent decode steps' (padded rows,
  seconds), as the executor reports them. Until the rows have varied enough to fit a slope, ``b`` is
  the share of one row in a step whose fixed cost is :data:`PRIOR_FIXED_ROWS` rows.
* a source's passes (MTP: one batched forward of a module, its head and the proposals): a line
  ``c0 + c1·rows`` through recent passes' (rows, seconds). A draft of ``n`` tokens takes about
  ``n`` passes of one row per request drafting, so with ``k`` requests drafting together each pays
  ``c0 / k + c1`` per token: a pass's fixed cost is shared by the requests it drafts for.

Before any step has been measured, a draft's gain is its ``E(n)`` (drafts are tried, which measures them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent_infer.model.layers.linear import pad_rows

#: Weight an estimate keeps per new observation.
DECAY = 0.95
#: Fixed cost of a step in rows, while the rows have not varied enough to fit the line.
PRIOR_FIXED_ROWS = 6.0
#: Least variance of the rows (in rows²) that fits a slope.
MIN_ROW_VARIANCE = 0.5


@dataclass
class _Line:
    """A weighted least-squares line ``y = a + b·x`` over exponentially decaying observations."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = DECAY
        self.w = d * self.w + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y

    def fit(self, prior_fixed: float) -> tuple[float, float] | None:
        """``(a, b)``, both >= 0; with too little spread in x, ``b`` such that ``a = prior_fixed·b``
        through the mean. None before any observation."""
        if self.w <= 0.0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var >= MIN_ROW_VARIANCE:
            b = max(0.0, (self.sxy / self.w - mx * my) / var)
            return max(0.0, my - b * mx), b
        b = my / (prior_fixed + mx) if prior_fixed + mx > 0 else 0.0
        return prior_fixed * b, b


@dataclass
class CostModel:
    """Online step and draft costs (see the module docstring) shared by an engine's requests."""

    row_multiple: int = 1
    step: _Line = field(default_factory=_Line)
    passes: dict[str, _Line] = field(default_factory=dict)
    #: Fits since the last observation (a plan asks for them per request and length).
    _step_fit: tuple[float, float] | None = None
    _pass_fits: dict[str, tuple[float, float] | None] = field(default_factory=dict)

    def pad(self, rows: int) -> int:
        """``rows`` rounded up to the model's row multiple."""
        return pad_rows(max(rows, 0), self.row_multiple)

    def observe_step(self, rows: int, seconds: float) -> None:
        """Account for a decode step of ``rows`` fed rows that took ``seconds``."""
        if rows > 0 and seconds >= 0.0:
            self.step.add(float(self.pad(rows)), seconds)
            self._step_fit = None

    def observe_pass(self, source: str, rows: int, seconds: float) -> None:
        """Account for one pass of ``source`` over ``rows`` rows that took ``seconds``."""
        if rows > 0 and seconds >= 0.0:
            self.passes.setdefault(source, _Line()).add(float(rows), seconds)
            self._pass_fits.pop(source, None)

    def step_line(self) -> tuple[float, float] | None:
        """``(a, b)`` of the step line; None before any step was measured."""
        if self._step_fit is None:
            self._step_fit = self.step.fit(PRIOR_FIXED_ROWS)
        return self._step_fit

    def step_time(self, rows: int) -> float | None:
        """Estimated seconds of a step of ``rows`` rows (None before any step was measured)."""
        line = self.step_line()
        return None if line is None else line[0] + line[1] * self.pad(rows)

    def pass_cost(self, source: str, requests: int) -> float:
        """Seconds one pass of ``source`` (a row per request) costs each of ``requests`` requests
        drafting together (0 before it was measured, or for a source without passes)."""
        if source in self._pass_fits:
            fit = self._pass_fits[source]
        else:
            line = self.passes.get(source)
            fit = self._pass_fits[source] = line.fit(0.0) if line is not None else None
        if fit is None:
            return 0.0
        return fit[0] / max(1, requests) + fit[1]

    def best_length(
        self,
        survival: list[float],
        batch: int,
        rows: int,
        per_token: float = 0.0,
        fixed: float = 0.0,
    ) -> tuple[int, float]:
        """The draft length ``n <= len(survival)`` with the largest net gain (see the module
        docstring) and that gain; ``(0, 0.0)`` when no length gains. ``per_token`` and ``fixed``
        are the source's seconds per drafted token and per draft, ``rows`` the step's rows without
        this draft."""
        base = self.step_time(rows)
        if base is None or base <= 0.0:
            return len(survival), sum(survival)
        line = self.step_line()
        assert line is not None
        b = line[1]
        scale = max(batch, 1) / base
        best_n, best = 0, 0.0
        expected = 0.0
        for n, s in enumerate(survival, start=1):
            expected += s
            rows_cost = b * (self.pad(rows + n) - self.pad(rows))
            gain = expected - scale * (rows_cost + fixed + per_token * n)
            if gain > best:
                best_n, best = n, gain
        return best_n, best
