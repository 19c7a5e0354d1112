"""MTP drafts: the checkpoint's multi-token-prediction modules, chained over their own outputs.

Module ``d`` (0-based) at position ``i`` reads an input state (the main model's hidden state at
``i`` for ``d = 0``, module ``d - 1``'s output at ``i`` after) and the token at ``i + d + 1``, and
predicts the token at ``i + d + 2`` (:mod:`agent_infer.model.families.deepseek_mtp`). Each module
has a latent cache of its own, addressed by the main cache's slots, so every committed position
passes through every module once:

* **catch-up** (:meth:`MTPDrafter.catch_up`): the rows a step committed (a prefill chunk, the
  pending token, the accepted draft tokens) are queued on the request with their main-model hidden
  states (``SpecState.mtp``); a module runs a queued position once the token it reads there is
  known, in one batched pass per module, writing its cache, and queues its outputs for the next
  module. A request catches up when it is about to draft (the first module; the others catch up in
  the chain's passes, which run their committed rows beside the drafted ones) and when a queue grows
  past its memory bound (:func:`queue_bound`; every module).
* **chain** (:meth:`MTPDrafter.propose`): with ``P`` the newest position the first module ran (its
  output there predicts the first token after the request's last, at ``P + 2``), step ``s`` of the
  chain uses module ``m = min(s, depth - 1)``. For ``s < depth``, module ``s`` runs the positions it
  has not run up to ``P`` (inputs: module ``s - 1``'s outputs there, committed or from step
  ``s - 1``; tokens: the draft so far), and its output at ``P`` predicts the token at ``P + s + 2``:
  DeepSeek's sequential MTP at inference (TensorRT-LLM's "MTP vanilla"). From ``s = depth`` on, the
  last module runs one position further per step, fed its own previous output and the token it just
  proposed (vLLM's and SGLang's MTP drafting with a single module). Tokens already known at a
  position (grammar-forced ones appended by jump-forward) are fed instead of proposals, so a draft
  can follow forced text.

Each proposal is the grammar-masked arg-max over the draft vocabulary (:mod:`.vocab`). The draft
stops when a proposal's probability falls below the request's confidence threshold
(:mod:`.schedule`), when the grammar allows nothing in the draft vocabulary, or at the request's
draft length. Drafted positions' cache entries go to scratch slots past the pool (one run per
module and request in the round); the next catch-up writes the real entries into the paged pool.

Cache entries in prefix-cached blocks are reused as another request wrote them; the entries of a
block's last positions depend on the tokens after it, so a request diverging right there sees a
slightly different MTP context: only draft quality changes, verification decides every token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from agent_infer.engine.drafts.base import MTP, Draft
from agent_infer.engine.drafts.schedule import ConfidenceSchedule
from agent_infer.engine.drafts.vocab import DraftVocab
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.spec_state import MTPQueue
from agent_infer.errors import EngineError
from agent_infer.model.families.deepseek_mtp import MTPRows, MTPStack
from agent_infer.model.layers.norm import RMSNorm

#: Longest draft, and most known (forced) tokens a chain may pass through before its proposals.
MAX_DRAFT = 32
MAX_KNOWN = 16
#: Bytes of committed rows a module's queue may hold before the request catches up without
#: drafting, and the fewest and most rows that bound allows. A request that never drafts never pays
#: for its catch-up, so the queue is bounded by memory; the row cap keeps a catch-up pass within
#: the size of a prefill chunk.
MAX_QUEUED_BYTES = 2 << 20
MIN_QUEUED = 64
MAX_QUEUED = 1024


def queue_bound(queue: MTPQueue) -> int:
    """Rows ``queue`` may hold before its request catches up: :data:`MAX_QUEUED_BYTES` of its
    rows, within ``[MIN_QUEUED, MAX_QUEUED]``."""
    if not queue.parts:
        return MAX_QUEUED
    part = queue.parts[0]
    row = int(part.shape[1]) * part.element_size()
    return max(MIN_QUEUED, min(MAX_QUEUED, MAX_QUEUED_BYTES // max(row, 1)))


@dataclass
class _Chain:
    """One request's draft round: the tokens from index ``newest + 2`` on (known, then proposed)."""

    seq: Sequence
    lane: int
    limit: int
    schedule: ConfidenceSchedule
    newest: int  # P: the first module's newest run position
    last: torch.Tensor  # the newest output, whose head decides the next token
    position: int  # that output's position
    #: Per module: its first position in scratch slots, and its outputs there so far.
    starts: list[int] = field(default_factory=list)
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    draft: Draft = field(default_factory=lambda: Draft(MTP))
    in_matcher: int = 0

    def token(self, index: int) -> int:
        """The token at ``index`` (a committed one, else one of this round's)."""
        tokens = self.seq.token_ids
        return tokens[index] if index < len(tokens) else self.fed[index - self.newest - 2]


@dataclass
class _Rows:
    """A chain's rows of one pass: input states, positions, and how many are committed (first)."""

    chain: _Chain
    inputs: torch.Tensor
    positions: list[int]
    committed: int


class MTPDrafter:
    """Owns the MTP modules' caches and drafts from them for a batch of requests.

    ``on_pass`` (when set) hears of every pass: how many rows it ran and its seconds (module
    forward, head and proposals), which is what drafting costs (:mod:`agent_infer.engine.drafts.cost`).
    """

    def __init__(
        self,
        stack: MTPStack,
        num_slots: int,
        block_size: int,
        max_seqs: int,
        base_confidence: float,
        vocab: DraftVocab,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if stack.depth < 1:
            raise EngineError("MTP drafts need a checkpoint with MTP layers")
        self.stack = stack
        self.depth = stack.depth
        self.block_size = block_size
        self.num_slots = num_slots
        self.max_seqs = max_seqs
        self.base_confidence = base_confidence
        self.device = device
        self.vocab = vocab.to(device)
        self.on_pass: Callable[[int, float], None] | None = None
        #: Scratch slots per request and module: the drafted positions of a round.
        self.scratch = MAX_DRAFT + MAX_KNOWN + self.depth + 1
        size = num_slots + max_seqs * self.scratch
        self.pools = [
            torch.zeros(size, stack.cache_width, device=device, dtype=dtype) for _ in range(self.depth)
        ]
        self.heads: list[tuple[RMSNorm, torch.Tensor]] = []
        for d in range(self.depth):
            norm, weight = stack.head(d)
            self.heads.append((norm, self.vocab.head(weight)))

    @property
    def pool(self) -> torch.Tensor:
        """The first module's cache pool."""
        return self.pools[0]

    @staticmethod
    def bytes_per_token(stack: MTPStack, dtype: torch.dtype) -> int:
        """Cache bytes the modules add per token slot."""
        return stack.depth * stack.cache_width * torch.empty((), dtype=dtype).element_size()

    def schedule(self, seq: Sequence) -> ConfidenceSchedule:
        """``seq``'s confidence schedule (made on first use)."""
        if seq.spec.confidence is None:
            base = seq.params.speculative_confidence
            seq.spec.confidence = ConfidenceSchedule(self.base_confidence if base is None else base)
        return seq.spec.confidence

    def _paged(self, seq: Sequence, end: int) -> torch.Tensor:
        """Slots of positions ``0 .. end - 1`` of ``seq`` in the paged pool."""
        bs = self.block_size
        blocks = torch.tensor(seq.block_table[: (end + bs - 1) // bs], dtype=torch.int64)
        return (blocks[:, None] * bs + torch.arange(bs, dtype=torch.int64)[None, :]).reshape(-1)[:end]

    def _scratch(self, lane: int, count: int) -> torch.Tensor:
        base = self.num_slots + lane * self.scratch
        return torch.arange(base, base + count, dtype=torch.int64)

    def needs_catch_up(self, seq: Sequence) -> bool:
        """Whether a queue of ``seq`` outgrew its bound (:data:`MAX_QUEUED_BYTES`)."""
        return any(q.queued > queue_bound(q) for q in seq.spec.mtp)

    def _timed(self, rows: int, started: float) -> None:
        if self.on_pass is not None:
            self.on_pass(rows, time.perf_counter() - started)

    @torch.inference_mode()
    def catch_up(self, seqs: list[Sequence], modules: int | None = None) -> None:
        """Run every queued committed row of ``seqs`` whose token is known through the first
        ``modules`` modules (default all), one batched pass per module."""
        live = [s for s in seqs if s.spec.mtp and not s.is_finished]
        for depth in range(self.depth if modules is None else min(modules, self.depth)):
            started = time.perf_counter()
            fed: list[tuple[MTPQueue, Sequence, int, int]] = []
            for seq in live:
                queues = seq.spec.mtp
                if len(queues) <= depth:
                    continue
                q = queues[depth]
                n = min(q.queued, seq.num_tokens - 1 - depth - q.first)
                if n > 0:
                    fed.append((q, seq, q.first, n))
            if not fed:
                continue
            hidden: list[torch.Tensor] = []
            ids: list[int] = []
            gathers: list[torch.Tensor] = []
            for q, seq, first, n in fed:
                hidden.append(q.take(n))
                ids.extend(seq.token_ids[first + depth + 1 : first + depth + 1 + n])
                gathers.append(self._paged(seq, first + n))
            counts = [n for *_, n in fed]
            positions = torch.cat([torch.arange(first, first + n) for _, _, first, n in fed])
            slots = torch.cat([g[-n:] for g, n in zip(gathers, counts)])
            out = self._forward(depth, torch.cat(hidden), ids, gathers, counts, positions, slots)
            row = 0
            for _, seq, first, n in fed:
                self._committed(seq, depth, first, out[row : row + n])
                row += n
            self._timed(sum(counts), started)

    def _committed(self, seq: Sequence, depth: int, first: int, rows: torch.Tensor) -> None:
        """Module ``depth`` ran committed positions ``first ..``: keep its newest output and queue
        the outputs for the next module."""
        q = seq.spec.mtp[depth]
        q.newest, q.output = first + int(rows.shape[0]) - 1, rows[-1:]
        if depth + 1 < self.depth:
            if len(seq.spec.mtp) <= depth + 1:
                seq.spec.mtp.append(MTPQueue())
            seq.spec.mtp[depth + 1].add(first, rows)

    def _forward(
        self,
        depth: int,
        hidden: torch.Tensor,
        ids: list[int],
        gathers: list[torch.Tensor],
        counts: list[int],
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        dev = self.device
        rows = MTPRows([g.to(dev) for g in gathers], counts, positions.to(dev), slots.to(dev))
        tokens = torch.tensor(ids, dtype=torch.int64, device=dev)
        return self.stack.forward(depth, hidden, tokens, rows, self.pools[depth])

    @torch.inference_mode()
    def propose(self, requests: list[tuple[Sequence, int]]) -> list[Draft]:
        """MTP drafts for ``(seq, limit)`` pairs, at most ``limit`` tokens each (after catching the
        first module up); an empty draft where a request has no module output to start from or
        its first proposal is not confident enough."""
        seqs = [seq for seq, _ in requests]
        # A module the chains seldom reach catches up in a pass of its own once its queue is long.
        self.catch_up([seq for seq in seqs if self.needs_catch_up(seq)])
        self.catch_up(seqs, modules=1)
        drafts = [Draft(MTP) for _ in requests]
        chains: list[tuple[int, _Chain]] = []
        for i, (seq, limit) in enumerate(requests[: self.max_seqs]):
            chain = self._start(seq, min(limit, MAX_DRAFT), len(chains))
            if chain is not None:
                chains.append((i, chain))
        try:
            self._run([chain for _, chain in chains])
        finally:
            for _, chain in chains:
                if chain.in_matcher and chain.seq.matcher is not None:
                    chain.seq.matcher.rollback(chain.in_matcher)
        for i, chain in chains:
            drafts[i] = chain.draft
        return drafts

    def _start(self, seq: Sequence, limit: int, lane: int) -> _Chain | None:
        queues = seq.spec.mtp
        if limit <= 0 or not queues or queues[0].output is None:
            return None
        newest = queues[0].newest
        known = seq.num_tokens - (newest + 2)
        if not 0 <= known <= MAX_KNOWN:
            return None
        chain = _Chain(seq, lane, limit, self.schedule(seq), newest, queues[0].output, newest)
        chain.starts = [newest + 1] * self.depth
        chain.outputs = [None] * self.depth
        return chain

    def _run(self, active: list[_Chain]) -> None:
        step = 0
        started = time.perf_counter()
        while active:
            module = min(step, self.depth - 1)
            rows = 0
            if step:
                started = time.perf_counter()
                active, rows = self._advance(active, step, module)
                if not active:
                    return
            norm, weight = self.heads[module]
            logits = F.linear(norm.forward(torch.cat([c.last for c in active])), weight).float()
            count = len(active)
            active = [c for j, c in enumerate(active) if self._next_token(c, logits[j])]
            self._timed(max(rows, count), started)
            step += 1

    def _advance(self, chains: list[_Chain], step: int, module: int) -> tuple[list[_Chain], int]:
        """Run ``module`` for chain step ``step`` (see the module docstring); the chains that could,
        and the rows the pass ran."""
        ready: list[_Chain] = []
        plans: list[_Rows] = []
        for c in chains:
            rows = self._module_rows(c, module) if step < self.depth else self._next_row(c)
            if rows is None:
                continue
            ready.append(c)
            if rows.positions:
                plans.append(rows)
        if not plans:
            return ready, 0
        ids: list[int] = []
        gathers: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        for r in plans:
            c = r.chain
            ids.extend(c.token(p + module + 1) for p in r.positions)
            # Committed positions live in the paged pool, drafted ones in the lane's scratch run.
            first = c.starts[module]
            end = r.positions[-1] + 1
            gather = torch.cat((self._paged(c.seq, first), self._scratch(c.lane, end - first)))
            gathers.append(gather)
            slots.append(gather[-len(r.positions) :])
        out = self._forward(
            module,
            torch.cat([r.inputs for r in plans]),
            ids,
            gathers,
            [len(r.positions) for r in plans],
            torch.cat([torch.arange(r.positions[0], r.positions[-1] + 1) for r in plans]),
            torch.cat(slots),
        )
        row = 0
        for r in plans:
            c = r.chain
            made = out[row : row + len(r.positions)]
            row += len(r.positions)
            if r.committed:
                c.seq.spec.mtp[module].take(r.committed)
                self._committed(c.seq, module, r.positions[0], made[: r.committed])
            drafted = made[r.committed :]
            if int(drafted.shape[0]):
                previous = c.outputs[module]
                c.outputs[module] = drafted if previous is None else torch.cat((previous, drafted))
            c.last, c.position = made[-1:], r.positions[-1]
        return ready, row

    def _next_row(self, c: _Chain) -> _Rows:
        """The last module one position past its newest output, fed that output."""
        return _Rows(c, c.last, [c.position + 1], 0)

    def _module_rows(self, c: _Chain, module: int) -> _Rows | None:
        """``module``'s rows from the first position it has not run to ``c.newest`` (none when it
        ran there already): first the committed ones (whose token is known), then the drafted
        ones. None when its state does not line up with the chain's (the chain then stops)."""
        queues = c.seq.spec.mtp
        if len(queues) <= module:
            return None
        q = queues[module]
        done = q.first - 1
        if q.output is not None and q.newest != done:
            return None
        if done >= c.newest:
            if q.output is None or done != c.newest:
                return None
            c.starts[module] = done + 1
            c.last, c.position = q.output, done
            return _Rows(c, c.last, [], 0)
        committed = max(0, min(c.newest, c.seq.num_tokens - 2 - module) - done)
        drafted = c.newest - done - committed
        if drafted > self.depth:
            return None
        c.starts[module] = done + 1 + committed
        # Module ``module - 1``'s outputs at positions done + 1 .. newest: committed ones queued
        # for this module, then the ones drafted at the previous step.
        parts: list[torch.Tensor] = []
        end = q.first
        if q.rows is not None:
            parts.append(q.rows)
            end += q.queued
        below = c.outputs[module - 1]
        if below is not None:
            if c.starts[module - 1] != end:
                return None
            parts.append(below)
            end += int(below.shape[0])
        if end <= c.newest:
            return None
        inputs = torch.cat(parts)[: c.newest - done]
        return _Rows(c, inputs, list(range(done + 1, c.newest + 1)), committed)

    def _next_token(self, chain: _Chain, logits: torch.Tensor) -> bool:
        """Decide the token the chain's newest output predicts: the known one there, else the
        confident proposal (appended to the draft). False when the chain stops."""
        seq = chain.seq
        index = chain.newest + 2 + len(chain.fed)
        if index < seq.num_tokens:
            chain.fed.append(seq.token_ids[index])
            return True
        matcher = seq.matcher
        proposal = self.vocab.propose(logits, matcher)
        if proposal is None or not chain.schedule.extends(proposal[1]):
            return False
        token, prob = proposal
        if matcher is not None:
            if not matcher.accept_token(token):
                return False
            chain.in_matcher += 1
        chain.draft.tokens.append(token)
        chain.draft.probs.append(prob)
        chain.fed.append(token)
        return len(chain.draft) < chain.limit
