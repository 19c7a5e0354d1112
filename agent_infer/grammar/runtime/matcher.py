"""GrammarMatcher: per-request grammar state that accepts tokens and fills next-token bitmasks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent_infer import envs
from agent_infer.errors import MatcherUsageError, TokenBitmaskError
from agent_infer.grammar.compile.compiler import CompiledGrammar
from agent_infer.grammar.runtime.bitmask_target import foreign_memory, row_view, tensor_rows
from agent_infer.grammar.runtime.matcher_args import batch_rows, int32, int_argument, row_index, text_bytes
from agent_infer.native import load_native


class GrammarMatcher:
    """Matches one generation against a compiled grammar.

    ``terminate_without_eos``: EOS is never allowed; the matcher counts as terminated once the
    grammar can end and nothing may follow. ``max_rollback_tokens``: how many recent steps
    :meth:`rollback` can undo (-1: unlimited).

    A matcher serves one thread at a time: a call made while another thread's call on it runs
    (accepts and fills release the GIL) raises :class:`~agent_infer.errors.MatcherBusyError`;
    :meth:`fork` gives each thread its own. A call that raises leaves the matcher as it was.
    """

    def __init__(
        self,
        compiled_grammar: CompiledGrammar,
        *,
        terminate_without_eos: bool = False,
        max_rollback_tokens: int = -1,
        _native: Any = None,
    ) -> None:
        if not isinstance(compiled_grammar, CompiledGrammar):
            raise MatcherUsageError(
                f"expected a CompiledGrammar (from GrammarCompiler), got {type(compiled_grammar).__name__}",
                argument="compiled_grammar",
            )
        max_rollback_tokens = int_argument(max_rollback_tokens, "max_rollback_tokens")
        if not -1 <= max_rollback_tokens < 2**31:
            raise MatcherUsageError(
                f"max_rollback_tokens must be -1 (unlimited) or a count below 2**31, got {max_rollback_tokens}",
                argument="max_rollback_tokens",
            )
        self._compiled = compiled_grammar
        self._terminate_without_eos = bool(terminate_without_eos)
        self._max_rollback = max_rollback_tokens
        self._m = _native or load_native().GrammarMatcher(
            compiled_grammar._native, self._terminate_without_eos, max_rollback_tokens
        )

    @property
    def compiled_grammar(self) -> CompiledGrammar:
        """The grammar being matched."""
        return self._compiled

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; returns False (state unchanged) if the grammar rejects it.

        Raises :class:`MatcherUsageError` for a token id that is not an int in the vocabulary,
        :class:`GrammarLimitError` when a byte exceeds the matching work budget (the matcher is
        then left as before the call).
        """
        try:
            return bool(self._m.accept_token(token_id))
        except MatcherUsageError:
            raise
        except TypeError:
            # nanobind refuses non-ints and ints outside int32 before the call reaches C++.
            token_id = int_argument(token_id, "token_id")
            return bool(self._m.accept_token(int32(token_id, "token_id", "outside the vocabulary")))

    def accept_string(self, text: str | bytes) -> bool:
        """Advance by raw text (one rollback step); returns False (state unchanged) if rejected."""
        return bool(self._m.accept_bytes(text_bytes(text, "text")))

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> bool:
        """Write the allowed next tokens into row ``index`` of an int32 bitmask.

        Returns True when the row restricts something (False: every token is allowed). Raises
        :class:`TokenBitmaskError` for a bitmask or row that cannot be filled in place.
        """
        rows = tensor_rows(bitmask)
        try:
            if rows is not None:
                return bool(self._m.fill_next_token_bitmask_at(*rows, index))
            return bool(self._m.fill_next_token_bitmask(row_view(bitmask), index, foreign_memory(bitmask)))
        except MatcherUsageError:
            raise
        except TypeError as exc:
            # nanobind refused an argument before the call reached C++ (the index, or an array
            # _row_view let through that the native side cannot write in place).
            index = row_index(index, "index")
            if not -(2**63) <= index < 2**63:
                raise TokenBitmaskError(f"bitmask row {index} is outside the bitmask") from None
            raise TokenBitmaskError(f"the bitmask cannot be filled in place: {exc}") from None

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last ``num_tokens`` accepted steps (0 <= num_tokens <= num_accepted_steps)."""
        num_tokens = int_argument(num_tokens, "num_tokens")
        self._m.rollback(int32(num_tokens, "num_tokens", "more than can be rolled back"))

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state."""
        return GrammarMatcher(
            self._compiled,
            terminate_without_eos=self._terminate_without_eos,
            max_rollback_tokens=self._max_rollback,
            _native=self._m.fork(),
        )

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._m.reset()

    def is_terminated(self) -> bool:
        """True once EOS was accepted (or, with ``terminate_without_eos``, once the grammar must end)."""
        return bool(self._m.is_terminated())

    def can_terminate(self) -> bool:
        """True if the text so far is a complete string of the grammar."""
        return bool(self._m.can_terminate())

    def find_forced_bytes(self) -> tuple[bytes, bool]:
        """The bytes the grammar fixes next, and whether it must end right after them."""
        data, must_end = self._m.forced_bytes()
        return bytes(data), bool(must_end)

    def find_forced_string(self) -> str:
        """The text the grammar fixes next (cut to whole UTF-8 characters)."""
        data, _ = self._m.forced_bytes()
        return _whole_chars(_from_char_start(bytes(data))).decode("utf-8")

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar fixes next, canonically tokenized and safe to append without sampling.

        Unless the grammar must end right after the forced text, a token is dropped from the end
        while its boundary moves when probe continuations are appended (text that follows could
        merge with it under canonical tokenization): each byte that may follow when there are
        few, else generic probes after dropping the last token. When the grammar must end
        immediately, the EOS token is forced too.
        """
        info = self._compiled.tokenizer_info
        data, must_end = self.find_forced_bytes()
        text_bytes, out, whole = self.forced_text_tokens(data)
        if not whole:
            must_end = False
        if text_bytes:
            text = text_bytes.decode("utf-8")
            if not must_end:
                for probe in self._boundary_probes(text_bytes, out):
                    while out and info.encode(text + probe)[: len(out)] != out:
                        out.pop()
        if must_end and not self._terminate_without_eos and info.eos_token_ids:
            out.append(info.eos_token_ids[0])
        return out

    def forced_text_tokens(self, data: bytes | None = None) -> tuple[bytes, list[int], bool]:
        """The forced text in whole characters (``data``, default :meth:`find_forced_bytes`), its
        canonical tokens as far as they spell it, and whether they spell all of ``data``.

        Empty when the text starts inside a character begun by the last accepted token: the rest
        of that character has no canonical tokenization of its own.
        """
        if data is None:
            data = self.find_forced_bytes()[0]
        if data and (data[0] & 0xC0) == 0x80:
            return b"", [], False
        text_bytes = _whole_chars(data)
        info = self._compiled.tokenizer_info
        out: list[int] = []
        pos = 0
        if text_bytes:
            for tid in info.encode(text_bytes.decode("utf-8")):
                piece = info.token_bytes(tid)
                if not piece or text_bytes[pos : pos + len(piece)] != piece:
                    break
                out.append(tid)
                pos += len(piece)
        return text_bytes, out, pos == len(data)

    def shortest_completion(self) -> bytes | None:
        """The fewest bytes that complete the text so far to a string of the grammar.

        ``b""`` when the grammar can end now; None once the matcher has terminated, or where that
        completion would close an item of a ``uniqueItems`` array equal to an earlier one, or
        take a string whose ``maxLength`` is counted at run time past it (the shortest completion
        is the grammar's, which sees neither the earlier items nor the count). Where the
        grammar leaves a choice of byte, readable ASCII (``a``, ``0``, ``A``, then the lowest
        printable) is preferred.
        """
        data = self._m.shortest_completion()
        return None if data is None else bytes(data)

    def closing_tokens(self) -> list[int] | None:
        """Tokens that end the document by its shortest completion, then EOS (unless not needed).

        The completion is tokenized canonically; bytes finishing a character begun by the last
        token use single-byte tokens. Returns None when the completion cannot be written in this
        tokenizer's tokens or the matcher has terminated. The matcher itself is not advanced.
        """
        data = self.shortest_completion()
        if data is None:
            return None
        info = self._compiled.tokenizer_info
        head = len(data) - len(_from_char_start(data))
        out: list[int] = []
        for b in data[:head]:
            token = info.byte_token(b)
            if token is None:
                return None
            out.append(token)
        rest = data[head:]
        if rest:
            try:
                text = rest.decode("utf-8")
            except UnicodeDecodeError:
                return None
            out.extend(info.encode(text))
        # Canonical tokenization may merge or split differently from the bytes: check they agree.
        if b"".join(info.token_bytes(t) for t in out) != data:
            return None
        if not self._terminate_without_eos and info.eos_token_ids:
            out.append(info.eos_token_ids[0])
        return out

    def _boundary_probes(self, text: bytes, out: list[int]) -> tuple[str, ...]:
        """Continuations to check the forced tokens against; may drop the last token from ``out``.

        When few bytes can follow the forced text (structure: ``":`` before a number, ``}``/``,``
        after a value), each of them is a probe, so the last forced token stays when no such
        continuation would merge with it. Otherwise the last token is dropped (text that follows
        could merge with it) and the generic probes check the rest.
        """
        follow = self._m.next_bytes_after(text)
        if follow and len(follow) <= _MAX_FOLLOW_BYTES and all(b < 0x80 for b in follow):
            return tuple(chr(b) + tail for b in follow for tail in _FOLLOW_TAILS)
        if out:
            out.pop()
        return _PROBES

    @property
    def num_accepted_steps(self) -> int:
        """Steps currently available to :meth:`rollback`."""
        return int(self._m.num_tokens())


# Follow sets up to this size are probed byte by byte, each byte followed by each tail.
_MAX_FOLLOW_BYTES = 8
_FOLLOW_TAILS = ("", "a", "0", " ", '"')
# Continuations tried when checking that forced token boundaries are stable.
_PROBES = ("a", "Z", "0", " ", " a", "\n", '"', "'", ",", ".", "}", "é", "日", "xxxxxxxx", "_", "-")


def _from_char_start(data: bytes) -> bytes:
    """``data`` without leading UTF-8 continuation bytes (the tail of a character begun earlier)."""
    start = 0
    while start < len(data) and start < 3 and (data[start] & 0xC0) == 0x80:
        start += 1
    return data[start:]


def _whole_chars(data: bytes) -> bytes:
    """``data`` without a trailing incomplete UTF-8 sequence."""
    end = len(data)
    i = end - 1
    while i >= 0 and end - i <= 4 and (data[i] & 0xC0) == 0x80:
        i -= 1
    if i >= 0:
        lead = data[i]
        need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
        if end - i < need:
            return data[:i]
    return data


_applied_spin_us: int | None = None  # AGENT_INFER_GRAMMAR_SPIN_US as last handed to the pool


def pool_settings() -> int:
    """Hand ``AGENT_INFER_GRAMMAR_SPIN_US`` to the batch-fill pool if it changed; return the pool size
    a batch fill asks for (``AGENT_INFER_GRAMMAR_THREADS``)."""
    global _applied_spin_us
    spin_us = envs.grammar_spin_us()
    if spin_us != _applied_spin_us:
        load_native().grammar_batch_spin(spin_us * 1000)
        _applied_spin_us = spin_us
    return envs.grammar_threads()


def fill_next_token_bitmask_batch(
    matchers: Sequence[GrammarMatcher],
    bitmask: Any,
    indices: Sequence[int] | None = None,
    *,
    num_threads: int | None = None,
) -> list[bool]:
    """Fill row ``indices[i]`` (default ``i``) for each matcher in C++ threads with the GIL released.

    Matchers must be distinct objects. ``num_threads`` caps the threads used (default: the pool,
    sized by ``AGENT_INFER_GRAMMAR_THREADS``, 0 = one per core); ``AGENT_INFER_GRAMMAR_SPIN_US``
    bounds how long its threads poll before blocking.
    """
    native = load_native()
    pool = pool_settings()
    rows = None if indices is None else batch_rows(indices)
    # The native side checks lengths, rows, widths and that no matcher appears twice.
    handles = []
    for i, m in enumerate(matchers):
        if not isinstance(m, GrammarMatcher):
            raise MatcherUsageError(
                f"matchers[{i}] is a {type(m).__name__}, not a GrammarMatcher", argument="matchers"
            )
        handles.append(m._m)
    threads = 0 if num_threads is None else int_argument(num_threads, "num_threads")
    if not 0 <= threads < 2**31:
        raise MatcherUsageError(f"num_threads must be 0 (all) or more, got {threads}", argument="num_threads")
    target = tensor_rows(bitmask)
    if target is not None:
        return list(native.fill_next_token_bitmask_batch_at(handles, *target, rows, threads, pool))
    return list(
        native.fill_next_token_bitmask_batch(
            handles, row_view(bitmask), rows, threads, pool, foreign_memory(bitmask)
        )
    )


class BatchGrammarMatcher:
    """Convenience wrapper holding a batch of matchers filled together with the thread pool."""

    def __init__(self, matchers: Sequence[GrammarMatcher], *, num_threads: int | None = None) -> None:
        self.matchers = list(matchers)
        self.num_threads = num_threads

    def fill_next_token_bitmask(self, bitmask: Any, indices: Sequence[int] | None = None) -> list[bool]:
        """Fill one bitmask row per matcher."""
        return fill_next_token_bitmask_batch(self.matchers, bitmask, indices, num_threads=self.num_threads)

    def accept_tokens(self, token_ids: Sequence[int]) -> list[bool]:
        """Advance each matcher by its token."""
        return [m.accept_token(t) for m, t in zip(self.matchers, token_ids)]
