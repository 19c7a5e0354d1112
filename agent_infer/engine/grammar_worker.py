"""Grammar compilation off the engine thread: a small worker pool that turns IR into matchers.

Lowering a constraint to the IR is cheap and happens in ``add_request`` (so a bad schema is
rejected at once); the token-level compile can take tens of milliseconds or more for a large
schema, and would stall every running request if the engine thread did it. The native compile
releases the GIL, so a couple of threads compile while the engine keeps stepping.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from agent_infer.errors import ConfigError, EngineError

if TYPE_CHECKING:
    from agent_infer.grammar.compile.compiler import CompiledGrammar
    from agent_infer.grammar.ir import Grammar
    from agent_infer.grammar.runtime.matcher import GrammarMatcher


class GrammarWorkerPool:
    """Runs ``compile_fn`` for submitted grammars on ``num_workers`` threads; yields fresh matchers.

    Threads start on the first submission, so unconstrained workloads never pay for them.
    """

    def __init__(self, compile_fn: Callable[[Grammar], CompiledGrammar], num_workers: int) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigError(f"grammar_workers must be a positive integer, got {num_workers!r}")
        self._compile = compile_fn
        self._executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="agent-infer-grammar")

    def submit(self, grammar: Grammar) -> Future[GrammarMatcher]:
        """Start compiling ``grammar``; the future holds a new matcher or the compile's exception.

        Raises :class:`EngineError` once the pool takes no new work: shut down with the engine, or
        the interpreter is exiting (``concurrent.futures`` stops every pool then).
        """
        try:
            return self._executor.submit(self._build, grammar)
        except RuntimeError as exc:
            raise EngineError(f"the grammar compile pool takes no new work ({exc})") from exc

    def _build(self, grammar: Grammar) -> GrammarMatcher:
        from agent_infer.grammar.runtime.matcher import GrammarMatcher

        return GrammarMatcher(self._compile(grammar))

    def shutdown(self) -> None:
        """Stop accepting work; queued compiles are cancelled, running ones finish in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)
