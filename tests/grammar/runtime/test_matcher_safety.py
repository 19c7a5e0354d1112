"""A matcher survives what plain Python code can do to it: threads, ambiguous grammars, limits
tripped mid-token, read-only buffers and bad arguments all end in typed errors, never in a
crash, a stall, a corrupted state or a silently ignored argument."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from grammar_support import GRAMMARS, INSTANCES, hf_tokenizer, tokenizer_info

from agent_infer.errors import (
    AgentInferError,
    GrammarLimitError,
    MatcherBusyError,
    TokenBitmaskError,
)
from agent_infer.grammar import Grammar, TokenizerInfo
from agent_infer.grammar.compile.compiler import CompiledGrammar, GrammarCompiler
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher, fill_next_token_bitmask_batch

# Quadratic work per byte: every completion rescans every earlier Earley set.
AMBIGUOUS = 'root ::= root root | "a"'
# After "zz" the set predicts 60 recursive rules (more items than the limit below); "zb" is short.
_WIDE = " | ".join(f"r{k}" for k in range(60))
_RULES = "\n".join(f'r{k} ::= "y{k}" r{k} | "x{k}"' for k in range(60))
WIDE = f'root ::= "zz" wide | "zb"\nwide ::= {_WIDE}\n{_RULES}'
FORCED_WIDE = f'root ::= "zz" wide\nwide ::= {_WIDE}\n{_RULES}'
# Whether "))" may follow depends on the nesting depth, which only the Earley sets know: multi-byte
# tokens of ( ) a are checked against them at every fill, at the ambiguous grammar's cost per byte.
PARENS = 'root ::= t\nt ::= t t | "a" | "(" t ")"'


def compile_ebnf(text: str, info: TokenizerInfo | None = None, **limits: Any) -> CompiledGrammar:
    """``text`` compiled afresh (cold caches) for ``info`` (default: the 257-token bytes vocabulary)."""
    compiler = GrammarCompiler(info or TokenizerInfo.bytes_only(), cache_enabled=False, **limits)
    return compiler.compile(Grammar.from_ebnf(text))


def mask_of(m: GrammarMatcher) -> np.ndarray:
    info = m.compiled_grammar.tokenizer_info
    row = allocate_token_bitmask(1, info.vocab_size)
    m.fill_next_token_bitmask(row)
    return row.numpy().copy()


def snapshot(m: GrammarMatcher) -> tuple[Any, ...]:
    """Everything observable about a matcher's position (the current set's items, origins included)."""
    return (
        m._m.debug_items(),
        m.num_accepted_steps,
        m.can_terminate(),
        m.is_terminated(),
        mask_of(m).tobytes(),
    )


# --- 1. threads -------------------------------------------------------------------------------


def _poll_until_busy(
    m: GrammarMatcher, worker: threading.Thread, call: Callable[[], object]
) -> MatcherBusyError:
    """Calls ``call`` while ``worker`` runs until one raises MatcherBusyError."""
    worker.start()
    seen = None
    while worker.is_alive() and seen is None:
        try:
            call()
        except MatcherBusyError as exc:
            seen = exc
    worker.join()
    assert seen is not None, "the other thread's call never overlapped (it held the GIL throughout)"
    return seen


def test_a_second_thread_is_refused_while_an_accept_runs() -> None:
    """accept_string releases the GIL; a call from another thread meanwhile raises, naming both."""
    m = GrammarMatcher(compile_ebnf(AMBIGUOUS))
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(m.accept_string("a" * 600)))
    err = _poll_until_busy(m, worker, lambda: m.num_accepted_steps)
    assert (err.operation, err.running) == ("num_accepted_steps", "accept_string")
    assert "accept_string is running on the same matcher" in str(err)
    assert isinstance(err, AgentInferError) and result == [True] and m.num_accepted_steps == 1


def test_a_matcher_in_a_running_batch_fill_is_busy() -> None:
    """Each fill here runs the Earley check of "))"-like tokens (about 2 ms with the GIL released)."""
    info = tokenizer_info("smollm2")
    compiled = compile_ebnf(PARENS, info)
    m, other = GrammarMatcher(compiled), GrammarMatcher(compiled)
    for matcher in (m, other):
        assert matcher.accept_string("((((" + "a" * 300)
    bitmask = allocate_token_bitmask(2, info.vocab_size)

    def fills() -> None:
        for _ in range(20):
            fill_next_token_bitmask_batch([other, m], bitmask)

    err = _poll_until_busy(m, threading.Thread(target=fills), m.can_terminate)
    assert (err.operation, err.running) == ("can_terminate", "fill_next_token_bitmask_batch")
    assert m.accept_string("))))") and m.can_terminate()


def test_threads_sharing_a_matcher_get_errors_not_heap_corruption() -> None:
    """One thread fills masks (GIL released) while another accepts and rolls back: a process that
    lets them race dies with "double free or corruption" within a second."""
    script = textwrap.dedent(
        """
        import sys, threading, time
        sys.path.insert(0, "tests/support")
        from grammar_support import GRAMMARS, INSTANCES, hf_tokenizer, tokenizer_info
        from agent_infer.errors import MatcherBusyError
        from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
        from agent_infer.grammar.compile.compiler import GrammarCompiler
        from agent_infer.grammar.runtime.matcher import GrammarMatcher

        info = tokenizer_info("smollm2")
        m = GrammarMatcher(GrammarCompiler(info).compile(GRAMMARS["order"]()))
        ids = hf_tokenizer("smollm2").encode(INSTANCES["order"][0], add_special_tokens=False).ids
        busy = [0, 0]
        stop = time.monotonic() + 1.5

        def fill():
            row = allocate_token_bitmask(1, info.vocab_size)
            while time.monotonic() < stop:
                try:
                    m.fill_next_token_bitmask(row)
                except MatcherBusyError:
                    busy[0] += 1

        def step():
            k = 0
            while time.monotonic() < stop:
                try:
                    if m.accept_token(ids[k % len(ids)]):
                        k += 1
                    elif m.num_accepted_steps:
                        m.rollback(1)
                        k -= 1
                except MatcherBusyError:
                    busy[1] += 1

        threads = [threading.Thread(target=fill), threading.Thread(target=step)]
        for t in threads: t.start()
        for t in threads: t.join()
        print("busy", sum(busy))
        """
    )
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 0  # they did collide, and were told


def test_a_compiled_grammar_shared_by_threads_gives_the_same_masks() -> None:
    """The compiled grammar's lazily filled caches (state masks, memoized checks) are shared by
    every matcher; threads filling them at once must see what one thread alone sees."""
    info = tokenizer_info("smollm2")
    ids = hf_tokenizer("smollm2").encode(INSTANCES["order"][0], add_special_tokens=False).ids
    grammar = GRAMMARS["order"]()

    def walk(compiled: CompiledGrammar, out: list[bytes], start: threading.Barrier | None) -> None:
        m = GrammarMatcher(compiled)
        if start is not None:
            start.wait()
        for t in ids:
            out.append(mask_of(m).tobytes())
            assert m.accept_token(t)

    reference: list[bytes] = []
    walk(GrammarCompiler(info, cache_enabled=False).compile(grammar), reference, None)
    shared = GrammarCompiler(info, cache_enabled=False).compile(grammar)
    start = threading.Barrier(4)
    results: list[list[bytes]] = [[] for _ in range(4)]
    threads = [threading.Thread(target=walk, args=(shared, r, start)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == reference for r in results)


# --- 2. work per byte and per mask ------------------------------------------------------------


def test_work_per_byte_is_bounded_and_configurable() -> None:
    m = GrammarMatcher(compile_ebnf(AMBIGUOUS, max_work_per_byte=20_000))
    with pytest.raises(
        GrammarLimitError, match=r"20000 parser steps for one byte \(max_work_per_byte\) at input offset"
    ):
        for _ in range(3000):
            assert m.accept_string("a")
    steps = m.num_accepted_steps
    assert steps < 300  # quadratic work per byte: the budget ends it early
    before = snapshot(m)
    with pytest.raises(GrammarLimitError):
        m.accept_string("a")
    assert snapshot(m) == before
    m.rollback(1)
    assert m.num_accepted_steps == steps - 1


def test_work_per_mask_is_bounded_and_a_failed_fill_changes_nothing() -> None:
    """The run-time check of uncertain tokens ("))", "()))", ...) shares one budget per fill."""
    info = tokenizer_info("smollm2")
    tight = GrammarMatcher(compile_ebnf(PARENS, info, max_work_per_mask=3_000))
    ample = GrammarMatcher(compile_ebnf(PARENS, info))
    for m in (tight, ample):
        assert m.accept_string("((" + "a" * 60)
    mask_of(ample)
    with pytest.raises(
        GrammarLimitError, match=r"3000 parser steps for one token mask .* at input offset 62"
    ):
        mask_of(tight)
    assert tight._m.debug_items() == ample._m.debug_items() and tight.num_accepted_steps == 1
    assert tight.accept_string("))") and ample.accept_string("))")
    assert tight._m.debug_items() == ample._m.debug_items() and tight.can_terminate()


def test_shortest_completion_work_is_bounded() -> None:
    """Each step of the completion search scans a whole Earley set: it shares the mask budget."""
    for budget, expected in ((50, None), (None, b"))")):
        limits = {} if budget is None else {"max_work_per_mask": budget}
        m = GrammarMatcher(compile_ebnf(PARENS, **limits))
        assert m.accept_string("((" + "a" * 60)
        if expected is None:
            with pytest.raises(GrammarLimitError, match=r"shortest completion .* \(max_work_per_mask\)"):
                m.shortest_completion()
        else:
            assert m.shortest_completion() == expected
        assert m.accept_string("))") and m.can_terminate()


def test_default_budgets_leave_ordinary_matching_alone() -> None:
    info = tokenizer_info("smollm2")
    m = GrammarMatcher(GrammarCompiler(info).compile(GRAMMARS["order"]()))
    for t in hf_tokenizer("smollm2").encode(INSTANCES["order"][0], add_special_tokens=False).ids:
        mask_of(m)
        assert m.accept_token(t)
    assert m.can_terminate()


@pytest.mark.parametrize("value", [0, -5, 1.5, "10", True])
def test_work_budgets_must_be_positive_ints(value: object) -> None:
    with pytest.raises(AgentInferError, match="max_work_per_byte"):
        GrammarCompiler(TokenizerInfo.bytes_only(), max_work_per_byte=value)  # type: ignore[arg-type]


# --- 3. a failed call leaves the matcher as it was ---------------------------------------------


def test_a_limit_tripped_mid_token_leaves_no_state_behind() -> None:
    compiled = compile_ebnf(WIDE, max_items_per_step=40)
    m, fresh = GrammarMatcher(compiled), GrammarMatcher(compiled)
    with pytest.raises(GrammarLimitError):
        m.accept_string("zz")  # the first "z" is fine, the second opens too many items
    assert snapshot(m) == snapshot(fresh)
    assert not fresh.accept_string("b") and not m.accept_string("b")  # "zb" needs the "z" it undid
    assert m.accept_string("zb") and m.can_terminate()


def test_failed_forced_bytes_and_lookahead_leave_no_state_behind() -> None:
    compiled = compile_ebnf(FORCED_WIDE, max_items_per_step=40)
    m, fresh = GrammarMatcher(compiled), GrammarMatcher(compiled)
    with pytest.raises(GrammarLimitError):
        m.find_forced_bytes()  # forced "zz": the second byte trips the limit
    assert snapshot(m) == snapshot(fresh)
    with pytest.raises(GrammarLimitError):
        m._m.next_bytes_after(b"zz")  # the lookahead behind forced_tokens' boundary probes
    assert snapshot(m) == snapshot(fresh)
    assert m.accept_string("z") and fresh.accept_string("z")
    assert snapshot(m) == snapshot(fresh)


# --- 4. read-only memory ------------------------------------------------------------------------


def test_read_only_memory_is_refused(tmp_path: Path) -> None:
    """A tensor over a read-only mapping (torch.from_numpy of a read-only np.memmap): writing it
    kills the process; the single fill, the batch fill and the numpy array itself are refused."""
    info = tokenizer_info("smollm2")
    m = GrammarMatcher(compile_ebnf(AMBIGUOUS, info))
    words = allocate_token_bitmask(1, info.vocab_size).shape[1]
    path = tmp_path / "mask.bin"
    np.arange(2 * words, dtype=np.int32).tofile(path)
    mapped = np.memmap(path, dtype=np.int32, mode="r", shape=(2, words))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable
        tensor = torch.from_numpy(mapped)
    with pytest.raises(TokenBitmaskError, match="read-only memory"):
        m.fill_next_token_bitmask(tensor, 1)
    with pytest.raises(TokenBitmaskError, match="read-only memory"):
        fill_next_token_bitmask_batch([m], tensor, [1])
    with pytest.raises(TokenBitmaskError, match="read-only"):
        fill_next_token_bitmask_batch([m], mapped)
    assert np.array_equal(mapped.ravel(), np.arange(2 * words, dtype=np.int32))


def test_tensors_over_foreign_writable_memory_are_filled() -> None:
    """Storage torch did not allocate, or whose address numpy took, is filled when writable."""
    info = tokenizer_info("smollm2")
    m = GrammarMatcher(compile_ebnf(AMBIGUOUS, info))
    expected = mask_of(m)
    own = allocate_token_bitmask(2, info.vocab_size)
    own.numpy()  # storage is no longer resizable once numpy holds its address
    wrapped = torch.from_numpy(np.zeros((2, own.shape[1]), np.int32))
    for tensor in (own, wrapped):
        m.fill_next_token_bitmask(tensor, 1)
        fill_next_token_bitmask_batch([m], tensor, [0])
        assert np.array_equal(tensor.numpy(), np.concatenate([expected, expected]))
