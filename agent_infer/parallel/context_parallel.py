"""Balanced context-parallel prefill of one long prompt over ranks (DeepSeek V3 / MLA models).

The prompt is cut into ``2R`` chunks and rank ``r`` takes chunks ``r`` and ``2R - 1 - r`` (the
zig-zag order): under a causal mask chunk ``i`` attends to ``i + 1`` chunks, so every rank's two
chunks attend to ``2R + 1`` chunks in all and the attention work is even. Per layer each rank
computes its tokens' latent entries (``[c, k_rope]``, the MLA cache rows), the ranks all-gather
them, and each rank attends its queries to every key chunk up to its own, one chunk at a time,
each piece returning its output and log-sum-exp; the pieces are merged exactly
(``lse = logsumexp_j lse_j``, ``o = sum_j exp(lse_j - lse) o_j``), as ring attention merges the
blocks it receives. Dense MLPs and MoE layers run on each rank's own tokens.

The result is single-rank prefill's to float32 rounding (not bit-identical: the softmax is
summed in pieces). Data-parallel ranks route long prompts here (``cp_engine.py``): the rank that
owns the request writes the latent rows into its paged cache and decodes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from agent_infer.errors import ConfigError
from agent_infer.model.families.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM
from agent_infer.model.layers.linear import in_row_chunks, pad_rows


def zigzag_chunks(length: int, num_ranks: int) -> list[list[tuple[int, int]]]:
    """Per rank, its two ``[start, end)`` position ranges: chunks ``r`` and ``2R - 1 - r`` of ``2R``
    near-equal chunks (the first ``length % 2R`` chunks one token longer)."""
    if num_ranks < 1 or length < 2 * num_ranks:
        raise ConfigError(f"a {length}-token prompt cannot be split into 2 x {num_ranks} chunks")
    n = 2 * num_ranks
    sizes = [length // n + (1 if i < length % n else 0) for i in range(n)]
    bounds = [sum(sizes[:i]) for i in range(n + 1)]
    chunks = [(bounds[i], bounds[i + 1]) for i in range(n)]
    return [[chunks[r], chunks[n - 1 - r]] for r in range(num_ranks)]


def attend_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries ``q`` ``[H, M, D]`` to keys/values ``[H, N, D]``/``[H, N, Dv]`` by
    absolute positions; float32 output ``[H, M, Dv]`` and log-sum-exp ``[H, M]`` (-inf where a query
    sees no key, with a zero output)."""
    scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return torch.matmul(weights, v.float()), lse


def lse_merge(outputs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """The attention over the union of the pieces' keys, from each piece's output ``[H, M, Dv]`` and
    log-sum-exp ``[H, M]``."""
    stacked = torch.stack(lses)
    total = torch.logsumexp(stacked, dim=0)
    safe = total.masked_fill(torch.isinf(total), 0.0)
    out = torch.zeros_like(outputs[0])
    for o, lse in zip(outputs, lses):
        out += torch.exp(lse - safe)[..., None] * o
    return out


@dataclass(frozen=True)
class PrefillResult:
    """Float32 logits ``[1, vocab]`` of the last position (``[L, vocab]`` of every position with
    ``all_logits``), each layer's latent cache rows ``[L, latent_dim]`` (what the rank that keeps
    the request writes into its paged cache) and the final-norm hidden rows ``[L, hidden]`` (what
    an MTP module reads)."""

    logits: torch.Tensor
    latents: list[torch.Tensor]
    hidden: torch.Tensor


@torch.inference_mode()
def context_parallel_prefill(
    model: DeepseekV3ForCausalLM,
    token_ids: list[int],
    group: dist.ProcessGroup | None = None,
    *,
    all_logits: bool = False,
) -> PrefillResult:
    """Prefill ``token_ids`` over the ranks of ``group`` (every rank calls this with the same prompt)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    length = len(token_ids)
    c = model.config
    if length > c.max_position_embeddings:
        raise ConfigError(
            f"a {length}-token prompt exceeds the model's {c.max_position_embeddings} positions"
        )
    plan = zigzag_chunks(length, world)
    positions = [torch.arange(a, b) for a, b in plan[rank]]
    pos = torch.cat(positions).to(model.device)
    n = int(pos.shape[0])
    rows = pad_rows(n, model.kernels.row_multiple)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=model.device)[pos]
    pad = rows - n
    ids_p = torch.cat((ids, ids.new_zeros(pad)))
    pos_p = torch.cat((pos, pos.new_zeros(pad)))
    rotation = model.rotary.at(pos_p)
    x = F.embedding(ids_p, model.embed)
    all_pos = [torch.cat([torch.arange(a, b) for a, b in p]) for p in plan]
    width = max(int(p.shape[0]) for p in all_pos)
    latents: list[torch.Tensor] = []
    for layer in model.blocks():
        attn_out, full = _attention(layer, x, rotation, n, pos, all_pos, width, group)
        latents.append(full)
        x = x + attn_out
        if layer.mlp is not None:
            x = x + layer.mlp.forward(x, layer.post_norm)
        else:
            assert layer.moe is not None
            y = layer.moe.forward(layer.post_norm.forward(x[:n]))
            x = x + torch.cat((y, y.new_zeros(pad, int(y.shape[1]))))
    hidden = model.norm.forward(x)[:n]
    gathered = _gather_rows(hidden, all_pos, width, length, group)
    return PrefillResult(model.compute_logits(gathered if all_logits else gathered[-1:]), latents, gathered)


def _attention(
    layer: DeepseekV3DecoderLayer,
    x: torch.Tensor,
    rotation: object,
    n: int,
    pos: torch.Tensor,
    all_pos: list[torch.Tensor],
    width: int,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA of this rank's rows against the whole prompt's latents; (output ``[rows, hidden]``, the
    prompt's latent rows ``[L, latent_dim]``)."""
    a = layer.attn
    m, heads = a.spec, a.heads
    rows = int(x.shape[0])
    nope, rope, lora = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    h = a.down.project_normed(x, layer.input_norm)
    q = h[:, : a.q_width]
    if a.q_up is not None and a.q_norm is not None:
        q = a.q_up.project(a.q_norm.forward(q))
    q = q.reshape(rows, heads, m.qk_head_dim)
    latent = a.kv_norm.forward(h[:, a.q_width : a.q_width + lora])
    ropes = torch.cat((q[:, :, nope:], h[:, None, a.q_width + lora :]), dim=1)
    if a.rope_order is not None:
        ropes = ropes.index_select(2, a.rope_order)
    ropes = rotation.apply(ropes.reshape(rows, (heads + 1) * rope), heads + 1, rope)  # type: ignore[attr-defined]
    q_full = torch.cat((q[:n, :, :nope], ropes[:n, :heads]), dim=-1).transpose(0, 1)
    entries = torch.cat((latent[:n], ropes[:n, heads]), dim=-1)
    length = sum(int(p.shape[0]) for p in all_pos)
    full = _gather_rows(entries, all_pos, width, length, group)
    kv = in_row_chunks(lambda t: F.linear(t, a.kv_b), full[:, :lora]).view(length, heads, nope + m.v_head_dim)
    k = torch.cat((kv[:, :, :nope], full[:, None, lora:].expand(length, heads, rope)), dim=-1).transpose(0, 1)
    v = kv[:, :, nope:].transpose(0, 1)
    key_pos = torch.arange(length, device=x.device)
    outs = []
    start = 0
    for chunk in _runs(pos):
        qc = q_full[:, start : start + len(chunk)]
        chunk_pos = pos[start : start + len(chunk)]
        pieces = [
            attend_with_lse(qc, k[:, ks:ke], v[:, ks:ke], chunk_pos, key_pos[ks:ke], a.scale)
            for ks, ke in _key_chunks(all_pos)
            if ks <= int(chunk_pos.max())
        ]
        outs.append(lse_merge([p[0] for p in pieces], [p[1] for p in pieces]))
        start += len(chunk)
    o = torch.cat(outs, dim=1).transpose(0, 1).reshape(n, heads * m.v_head_dim).to(x.dtype)
    if rows > n:
        o = torch.cat((o, o.new_zeros(rows - n, int(o.shape[1]))))
    return a.o.project(o), full


def _runs(pos: torch.Tensor) -> list[list[int]]:
    """Consecutive position runs of ``pos`` (this rank's chunks)."""
    runs: list[list[int]] = []
    for p in pos.tolist():
        if runs and runs[-1][-1] + 1 == p:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _key_chunks(all_pos: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Every rank's chunks as ``[start, end)`` ranges, in position order (the merge's key pieces)."""
    chunks = [(run[0], run[-1] + 1) for p in all_pos for run in _runs(p)]
    return sorted(chunks)


def _gather_rows(
    local: torch.Tensor, all_pos: list[torch.Tensor], width: int, length: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Every rank's rows (``local`` here, padded to ``width`` for the all-gather) placed at their
    positions: ``[length, ...]``."""
    padded = torch.cat((local, local.new_zeros(width - int(local.shape[0]), *local.shape[1:]))).contiguous()
    parts = [torch.empty_like(padded) for _ in all_pos]
    dist.all_gather(parts, padded, group=group)
    out = local.new_empty(length, *local.shape[1:])
    for part, p in zip(parts, all_pos):
        out[p.to(out.device)] = part[: int(p.shape[0])]
    return out
