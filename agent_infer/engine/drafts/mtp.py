"""MTP drafts: the checkpoint's own multi-token-prediction module, chained over its own outputs.

The MTP module at position ``p`` reads the main model's hidden state there and the token at
``p + 1`` and predicts the token at ``p + 2`` (:mod:`agent_infer.model.families.deepseek_mtp`).
Its attention has a latent cache of its own, addressed by the same slots as the main model's, so
every committed position must pass through it once:

* **catch-up** (:meth:`MTPDrafter.catch_up`, once per step for every MTP request): the rows the
  step committed (a prefill chunk, the pending token, the accepted draft tokens) are queued on the
  request by the executor with their main-model hidden states; once their next tokens are known
  they run through the module in one batched pass, writing its cache. The output at the newest
  position predicts the first token after the request's last one.
* **chain** (:meth:`MTPDrafter.propose`): each further draft token feeds the module its own
  previous output and the token it just proposed, one position further (vLLM's and SGLang's MTP
  drafting). Tokens already known there (grammar-forced ones appended by jump-forward) are fed
  instead of proposals, so a draft can follow forced text. Each proposal is the arg-max of the
  module's logits under the request's grammar mask at that position, and the draft stops when its
  probability falls below the request's confidence threshold (:mod:`.schedule`) or the request's
  draft length is reached. Chained positions are not committed: their cache entries go to scratch
  slots past the pool (one run of them per request in the step), and the next catch-up writes the
  real entries into the paged pool.

With several MTP modules in a checkpoint the first one is chained (DeepSeek V3 ships one). The
module's cache entries in prefix-cached blocks are reused as another request wrote them; the entry
of a block's last position depends on the token after the block, so a request that diverges right
there sees a slightly different MTP context. That changes only how good its drafts are:
verification decides every output token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_infer.engine.drafts.base import MTP, Draft
from agent_infer.engine.drafts.schedule import ConfidenceSchedule
from agent_infer.engine.sequence import Sequence
from agent_infer.errors import EngineError
from agent_infer.model.families.deepseek_v3 import DeepseekV3ForCausalLM
from agent_infer.model.layers.attention import AttentionMetadata, AttentionPlan, PagedAttention, _SeqPlan

#: Longest draft, and most known (forced) tokens a chain may pass through before its proposals.
MAX_DRAFT = 32
MAX_KNOWN = 16
SCRATCH_PER_SEQ = MAX_DRAFT + MAX_KNOWN


@dataclass
class _Chain:
    seq: Sequence
    limit: int
    schedule: ConfidenceSchedule
    base: torch.Tensor  # slots of the committed context
    hidden: torch.Tensor
    logits: torch.Tensor
    pos: int  # position of the newest module output
    lane: int  # which run of scratch slots
    draft: Draft = field(default_factory=lambda: Draft(MTP))
    in_matcher: int = 0


class MTPDrafter:
    """Owns the MTP module's latent cache and drafts from it for a batch of requests."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        num_slots: int,
        block_size: int,
        max_seqs: int,
        base_confidence: float,
    ) -> None:
        layers = model.mtp_layers()
        if not layers or model.config.mla is None:
            raise EngineError("MTP drafts need a DeepSeek V3 checkpoint with MTP layers")
        self.model = model
        self.layer = layers[0]
        self.block_size = block_size
        self.num_slots = num_slots
        self.max_seqs = max_seqs
        self.base_confidence = base_confidence
        self.device = model.device
        width = model.config.mla.latent_dim
        self.pool = torch.zeros(
            num_slots + max_seqs * SCRATCH_PER_SEQ, width, device=self.device, dtype=model.dtype
        )
        self.planner = PagedAttention()

    @staticmethod
    def bytes_per_token(model: DeepseekV3ForCausalLM, dtype: torch.dtype) -> int:
        """Cache bytes the module adds per token slot."""
        assert model.config.mla is not None
        return model.config.mla.latent_dim * torch.empty((), dtype=dtype).element_size()

    def schedule(self, seq: Sequence) -> ConfidenceSchedule:
        """``seq``'s confidence schedule (made on first use)."""
        if seq.spec.confidence is None:
            base = seq.params.speculative_confidence
            seq.spec.confidence = ConfidenceSchedule(self.base_confidence if base is None else base)
        return seq.spec.confidence

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def catch_up(self, seqs: list[Sequence]) -> None:
        """Run the queued committed rows of ``seqs`` whose next token is known through the module
        (one pass), keeping each request's newest output for :meth:`propose`."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        ctx: list[int] = []
        tables: list[list[int]] = []
        hidden: list[torch.Tensor] = []
        fed: list[Sequence] = []
        for seq in seqs:
            spec = seq.spec
            rows = spec.mtp_rows
            if rows is None or seq.is_finished:
                continue
            first = spec.mtp_first
            n = min(int(rows.shape[0]), seq.num_tokens - 1 - first)
            if n <= 0:
                continue
            ids.extend(seq.token_ids[first + 1 : first + n + 1])
            positions.extend(range(first, first + n))
            slots.extend(self._slots(seq, first, first + n))
            qsl.append(len(ids))
            ctx.append(first + n)
            tables.append(seq.block_table)
            hidden.append(rows[:n])
            spec.mtp_rows = rows[n:] if n < int(rows.shape[0]) else None
            spec.mtp_first = first + n
            spec.mtp_pos = first + n - 1
            fed.append(seq)
        if not fed:
            return
        meta = AttentionMetadata(
            qsl, ctx, tables, torch.tensor(slots, dtype=torch.int64, device=self.device), self.block_size
        )
        plan = self.planner.plan(meta, len(ids), self.num_slots, self.device)
        out = self._forward(torch.cat(hidden), ids, positions, plan)
        last = torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.int64, device=out.device)
        newest = out.index_select(0, last)
        logits = self.layer.logits(newest, self.model.lm_head)
        for i, seq in enumerate(fed):
            seq.spec.mtp_hidden = newest[i : i + 1]
            seq.spec.mtp_logits = logits[i]

    def _forward(
        self, hidden: torch.Tensor, ids: list[int], positions: list[int], plan: AttentionPlan
    ) -> torch.Tensor:
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        tokens = torch.tensor(ids, dtype=torch.int64, device=self.device)
        rotation = self.model.rotary.at(pos)
        return self.layer.forward(hidden, tokens, self.model.embed, rotation, self.pool, plan)

    @torch.inference_mode()
    def propose(self, requests: list[tuple[Sequence, int]]) -> list[Draft]:
        """MTP drafts for ``(seq, limit)`` pairs (after :meth:`catch_up`), at most ``limit`` tokens
        each; an empty draft where the request has no module output to start from or its first
        proposal is not confident enough."""
        drafts = [Draft(MTP) for _ in requests]
        chains: list[tuple[int, _Chain]] = []
        for i, (seq, limit) in enumerate(requests[: self.max_seqs]):
            spec = seq.spec
            if spec.mtp_pos is None or spec.mtp_hidden is None or spec.mtp_logits is None or limit <= 0:
                continue
            known = seq.num_tokens - (spec.mtp_pos + 2)
            if not 0 <= known <= MAX_KNOWN:
                continue
            base = torch.tensor(self._slots(seq, 0, spec.mtp_pos + 1), dtype=torch.int64, device=self.device)
            chain = _Chain(
                seq, min(limit, MAX_DRAFT), self.schedule(seq), base, spec.mtp_hidden, spec.mtp_logits,
                spec.mtp_pos, len(chains),
            )  # fmt: skip
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

    def _run(self, active: list[_Chain]) -> None:
        step = 0
        while active:
            fed: list[tuple[_Chain, int]] = []
            for chain in active:
                token = self._next_token(chain)
                if token is not None:
                    fed.append((chain, token))
            if not fed:
                return
            scratch = [self.num_slots + c.lane * SCRATCH_PER_SEQ for c, _ in fed]
            plans = [
                _SeqPlan(
                    j, j + 1,
                    torch.cat((c.base, torch.arange(s, s + step + 1, device=self.device))), None, False,
                )
                for j, ((c, _), s) in enumerate(zip(fed, scratch))
            ]  # fmt: skip
            slot_map = torch.tensor([s + step for s in scratch], dtype=torch.int64, device=self.device)
            plan = AttentionPlan(seqs=plans, slot_mapping=slot_map, num_tokens=len(fed))
            out = self._forward(
                torch.cat([c.hidden for c, _ in fed]), [t for _, t in fed], [c.pos + 1 for c, _ in fed], plan
            )
            logits = self.layer.logits(out, self.model.lm_head)
            for j, (c, _) in enumerate(fed):
                c.hidden, c.logits, c.pos = out[j : j + 1], logits[j], c.pos + 1
            active = [c for c, _ in fed]
            step += 1

    def _next_token(self, chain: _Chain) -> int | None:
        """The token fed at the chain's next position: the known one there, else the confident
        proposal (appended to the draft); None when the chain stops."""
        seq = chain.seq
        index = chain.pos + 2  # the token the newest output predicts
        if index < seq.num_tokens:
            return seq.token_ids[index]
        logits = chain.logits.float()
        matcher = seq.matcher
        if matcher is not None:
            if matcher.is_terminated():
                return None
            from agent_infer.grammar.runtime.bitmask import (
                allocate_token_bitmask,
                apply_token_bitmask_inplace,
            )

            mask = allocate_token_bitmask(1, int(logits.shape[-1]))
            matcher.fill_next_token_bitmask(mask, 0)
            logits = logits.clone()[None]
            apply_token_bitmask_inplace(logits, mask)
            logits = logits[0]
        probs = torch.softmax(logits, dim=-1)
        token = int(probs.argmax())
        prob = float(probs[token])
        if not chain.schedule.extends(prob):
            return None
        if matcher is not None:
            if not matcher.accept_token(token):
                return None
            chain.in_matcher += 1
        chain.draft.tokens.append(token)
        chain.draft.probs.append(prob)
        return token if len(chain.draft) < chain.limit else None
