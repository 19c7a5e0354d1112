"""The cyclic-GC pause around grammar building: re-entrant, thread-safe, restores what it found."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from agent_infer import grammar as g
from agent_infer.errors import GrammarDefinitionError, GrammarLimitError, InvalidSchemaError
from agent_infer.grammar.common.gc_pause import gc_paused, pauses_gc


@pytest.fixture(autouse=True)
def _gc_enabled_around() -> Iterator[None]:
    """Each test starts with collection enabled and leaves it as the rest of the suite expects."""
    was = gc.isenabled()
    gc.enable()
    yield
    assert gc_paused.holders == 0
    if was:
        gc.enable()
    else:
        gc.disable()


def test_pause_disables_and_restores() -> None:
    with gc_paused:
        assert not gc.isenabled()
        assert gc_paused.holders == 1
    assert gc.isenabled()


def test_nested_pauses_restore_only_at_the_outermost_exit() -> None:
    with gc_paused:
        with gc_paused:
            assert gc_paused.holders == 2
        assert not gc.isenabled(), "the inner exit must not re-enable collection"
    assert gc.isenabled()


def test_never_enables_a_collector_the_caller_disabled() -> None:
    gc.disable()
    with gc_paused, gc_paused:
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_restores_on_exception() -> None:
    with pytest.raises(ValueError, match="boom"), gc_paused:
        raise ValueError("boom")
    assert gc.isenabled()
    assert gc_paused.holders == 0


def test_decorator_passes_results_and_errors_through() -> None:
    @pauses_gc
    def work(x: int) -> tuple[int, bool]:
        if x < 0:
            raise GrammarDefinitionError("negative")
        return x * 2, gc.isenabled()

    assert work(4) == (8, False)
    with pytest.raises(GrammarDefinitionError):
        work(-1)
    assert gc.isenabled()
    assert work.__name__ == "work"


def test_threads_overlapping_pauses_restore_after_the_last_one() -> None:
    """Two threads hold the pause with interleaved exits: collection stays off until both left."""
    entered = threading.Barrier(3)
    first_may_leave = threading.Event()
    first_left = threading.Event()
    second_may_leave = threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with gc_paused:
            entered.wait()
            first_may_leave.wait()
        first_left.set()

    def second() -> None:
        with gc_paused:
            entered.wait()
            second_may_leave.wait()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    entered.wait()
    seen["both_in"] = gc.isenabled()
    first_may_leave.set()
    first_left.wait()
    seen["one_left"] = gc.isenabled()
    second_may_leave.set()
    for t in threads:
        t.join()
    assert seen == {"both_in": False, "one_left": False}
    assert gc.isenabled()


def test_many_threads_compiling_at_once_restore_collection() -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def build(i: int) -> None:
        try:
            start.wait()
            for k in range(20):
                schema = {"type": "object", "properties": {f"p{i}_{k}": {"type": "integer"}}}
                g.Grammar.from_json_schema(schema)
                g.Grammar.from_regex(f"a{{{k}}}b")
        except BaseException as exc:  # collected for the assertion in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert gc.isenabled()


def test_front_ends_run_with_collection_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent_infer.grammar.frontends.ebnf import gbnf
    from agent_infer.grammar.frontends.json_schema import entry as json_schema
    from agent_infer.grammar.frontends.regex import parser as regex

    states: list[bool] = []

    def wrap(module: object, name: str) -> None:
        real = getattr(module, name)

        def spy(*args: object, **kwargs: object) -> object:
            states.append(gc.isenabled())
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    # Functions each front end calls inside its registered builder.
    wrap(json_schema, "build_registry")
    wrap(regex, "parse_regex")
    wrap(gbnf, "_Parser")
    g.Grammar.from_json_schema({"type": "string"})
    g.Grammar.from_regex("[a-z]+")
    g.Grammar.from_ebnf('root ::= "x"')
    assert states == [False, False, False]
    assert gc.isenabled()


def test_compiler_entry_points_pause_and_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent_infer.grammar.compile import compiler as compiler_module

    info = g.TokenizerInfo([b"a", b"b", b'"', b"{", b"}", b"1", b""], vocab_size=7, eos_token_ids=(6,))
    comp = g.GrammarCompiler(info, cache_enabled=False)
    states: list[bool] = []
    real = compiler_module.serialize_for_compile

    def spy(grammar: g.Grammar) -> object:
        states.append(gc.isenabled())
        return real(grammar)

    monkeypatch.setattr(compiler_module, "serialize_for_compile", spy)
    comp.compile_json_schema({"type": "integer"})
    comp.compile_regex("a+b")
    comp.compile_ebnf('root ::= "a" "b"?')
    comp.compile_builtin("json")
    comp.compile(g.Grammar.from_regex("b"))
    assert states == [False] * 5
    assert gc.isenabled()


def test_errors_inside_front_ends_restore_collection() -> None:
    with pytest.raises(InvalidSchemaError):
        g.Grammar.from_json_schema({"type": "no-such-type"})
    with pytest.raises(GrammarDefinitionError):
        g.Grammar.from_ebnf("root ::= undefined-rule")
    assert gc.isenabled()
    assert gc_paused.holders == 0


def test_tokenizer_info_keeps_a_tuple_of_bytes_as_given() -> None:
    """A new 129k-item tuple per TokenizerInfo would be one more container for the collector to
    traverse; a tuple of bytes is shared, anything else is copied into one."""
    vocab = (b"a", b"b", b"ab", b"{", b"}", b'"')
    info = g.TokenizerInfo(vocab, vocab_size=8, eos_token_ids=(7,))
    assert info._token_bytes is vocab
    assert info.decoded_vocab == list(vocab)
    listed = g.TokenizerInfo(list(vocab), vocab_size=8, eos_token_ids=(7,))
    assert type(listed._token_bytes) is tuple and listed._token_bytes == vocab
    mixed = g.TokenizerInfo((b"a", bytearray(b"b")), vocab_size=4, eos_token_ids=(3,))
    assert mixed._token_bytes == (b"a", b"b") and all(type(b) is bytes for b in mixed._token_bytes)


def test_a_build_cut_off_by_a_limit_collects_before_it_raises() -> None:
    # The churn of a build stopped by a size limit is collected in the failing call (a full
    # collection: it empties the free lists and unmaps the arenas they pinned), not in the next one.
    defs: dict[str, object] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(80)}
    defs["d80"] = {"type": "integer"}
    seen: list[int] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(watch)
    try:
        with pytest.raises(GrammarLimitError):
            g.Grammar.from_json_schema({"$defs": defs, "$ref": "#/$defs/d0"})
        failed = list(seen)
        seen.clear()
        # With automatic collection off, only an explicit collection could show up here.
        gc.disable()
        try:
            g.Grammar.from_json_schema({"$defs": defs, "properties": {"x": {"$ref": "#/$defs/d40"}}})
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(watch)
    assert 2 in failed
    assert 2 not in seen  # a build that succeeds is not charged a full collection
