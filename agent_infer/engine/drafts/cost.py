"""What steps and drafts cost, measured online, and how long a draft pays to be.

A step feeding ``R`` rows, ``k`` requests of which carry a draft, takes about
``T(R, k) = a + b·pad(R) + d·k`` seconds: ``a`` is what every step pays once, ``b`` one more row,
``pad`` rounds up to the model's row multiple (the torch CPU path runs every matmul on chunks of 4
rows, so the 2nd to 4th row of a chunk cost nothing more), and ``d`` what a request pays for
verifying a draft at all (its rows leave the one-row decode path for a chunk's, and the mask and
verification walk them). In a batch of ``B`` requests, a draft of ``n`` tokens whose first ``i`` are
kept with chance ``S_i`` (:mod:`.survival`) adds ``E(n) = sum_{i <= n} S_i`` tokens to the step's
output, and costs the whole batch its rows and its request's switch, ``T(R + n, k + 1) - T(R, k)``,
plus what its source spends proposing it, ``c(n)``. The batch's
tokens per second rise when ``(B + E) / (T + Δ) > B / T``, i.e. when the draft's *net gain*
``E(n) - B·(T(R + n) - T(R) + c(n)) / T(R)`` is positive. A request drafts from the source whose
best length has the largest positive gain, at that length; none when no gain is positive.

Every estimate is exponentially weighted (weight :data:`DECAY` per observation), so it follows the
machine's load and the batch as they change:

* ``a``, ``b`` and ``d``: a weighted least-squares fit through recent decode steps' (padded rows,
  requests with a draft, seconds), as the executor reports them. Until the rows have varied enough
  to fit a slope, ``b`` is the share of one row in a step whose fixed cost is
  :data:`PRIOR_FIXED_ROWS` rows; ``d`` is 0 until the number of drafting requests has varied apart
  from the rows (and never below 0), and keeps its last fitted value while it does not (a batch
  that stopped drafting because of ``d`` shows no drafting requests to fit it on).
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
#: Least variance of the drafting requests, and least share of it not explained by the rows, that
#: fit ``d``.
MIN_DRAFTER_VARIANCE = 0.05
MIN_INDEPENDENCE = 0.05


@dataclass
class _Plane:
    """A weighted least-squares fit ``y = a + b·x + d·z`` over exponentially decaying observations."""

    w: float = 0.0
    sx: float = 0.0
    sz: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    szz: float = 0.0
    sxz: float = 0.0
    sxy: float = 0.0
    szy: float = 0.0

    def add(self, x: float, z: float, y: float) -> None:
        d = DECAY
        self.w = d * self.w + 1.0
        self.sx = d * self.sx + x
        self.sz = d * self.sz + z
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.szz = d * self.szz + z * z
        self.sxz = d * self.sxz + x * z
        self.sxy = d * self.sxy + x * y
        self.szy = d * self.szy + z * y

    def fit(self, prior_fixed: float) -> tuple[float, float, float | None] | None:
        """``(a, b, d)``, all >= 0, ``d`` None where the observations cannot tell it apart (then
        ``a`` and ``b`` are :meth:`_Line.fit`'s); None before any observation."""
        if self.w <= 0.0:
            return None
        w = self.w
        mx, mz, my = self.sx / w, self.sz / w, self.sy / w
        vxx, vzz = self.sxx / w - mx * mx, self.szz / w - mz * mz
        vxz, vxy, vzy = self.sxz / w - mx * mz, self.sxy / w - mx * my, self.szy / w - mz * my
        det = vxx * vzz - vxz * vxz
        if vxx >= MIN_ROW_VARIANCE and vzz >= MIN_DRAFTER_VARIANCE and det >= MIN_INDEPENDENCE * vxx * vzz:
            b = (vxy * vzz - vzy * vxz) / det
            d = (vzy * vxx - vxy * vxz) / det
            if b >= 0.0 and d >= 0.0:
                return max(0.0, my - b * mx - d * mz), b, d
        line = _Line(w, self.sx, self.sy, self.sxx, self.sxy).fit(prior_fixed)
        assert line is not None
        return line[0], line[1], None


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
    step: _Plane = field(default_factory=_Plane)
    passes: dict[str, _Line] = field(default_factory=dict)
    #: Fits since the last observation (a plan asks for them per request and length).
    _step_fit: tuple[float, float, float] | None = None
    #: The last ``d`` the steps could tell apart: it is kept while they cannot (no request drafted
    #: lately, which is what a fitted ``d`` brings about), so drafting does not turn back on by
    #: forgetting what it costs.
    _known_d: float = 0.0
    _pass_fits: dict[str, tuple[float, float] | None] = field(default_factory=dict)

    def pad(self, rows: int) -> int:
        """``rows`` rounded up to the model's row multiple."""
        return pad_rows(max(rows, 0), self.row_multiple)

    def observe_step(self, rows: int, seconds: float, drafting: int = 0) -> None:
        """Account for a decode step of ``rows`` fed rows, ``drafting`` requests of which carried a
        draft, that took ``seconds``."""
        if rows > 0 and seconds >= 0.0:
            self.step.add(float(self.pad(rows)), float(drafting), seconds)
            self._step_fit = None

    def observe_pass(self, source: str, rows: int, seconds: float) -> None:
        """Account for one pass of ``source`` over ``rows`` rows that took ``seconds``."""
        if rows > 0 and seconds >= 0.0:
            self.passes.setdefault(source, _Line()).add(float(rows), seconds)
            self._pass_fits.pop(source, None)

    def _fit(self) -> tuple[float, float, float] | None:
        if self._step_fit is None:
            fit = self.step.fit(PRIOR_FIXED_ROWS)
            if fit is not None:
                a, b, d = fit
                if d is None:
                    d = self._known_d
                self._known_d = d
                self._step_fit = (a, b, d)
        return self._step_fit

    def step_line(self) -> tuple[float, float] | None:
        """``(a, b)`` of the step fit; None before any step was measured."""
        fit = self._fit()
        return None if fit is None else (fit[0], fit[1])

    def per_draft(self) -> float:
        """``d``: seconds a step pays per request carrying a draft (0 before it could be fitted)."""
        fit = self._fit()
        return 0.0 if fit is None else fit[2]

    def step_time(self, rows: int, drafting: int = 0) -> float | None:
        """Estimated seconds of a step of ``rows`` rows, ``drafting`` requests of which carry a draft
        (None before any step was measured)."""
        fit = self._fit()
        return None if fit is None else fit[0] + fit[1] * self.pad(rows) + fit[2] * drafting

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
        are the source's seconds per drafted token and per draft (the step's own cost of a draft,
        ``d``, is added), ``rows`` the step's rows without this draft."""
        base = self.step_time(rows)
        if base is None or base <= 0.0:
            return len(survival), sum(survival)
        line = self.step_line()
        assert line is not None
        b = line[1]
        fixed += self.per_draft()
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
