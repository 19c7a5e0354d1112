"""Fuzzing the grammar stack: regexes, JSON Schemas, mutated grammar texts and stress cases (deep
nesting, huge repeats, extreme keyword values), each run in a guarded worker.

Properties (see ``fuzz_worker``): no crash, hang or memory blow-up; only ``AgentInferError``
escapes; the matcher accepts exactly what ``re``/``jsonschema``/the reference recognizer accept;
masks over the real SmolLM2 and DeepSeek-V4 vocabularies equal what ``accept_token`` accepts.
A failure prints the case and how to re-run it. Failing cases shrink (Hypothesis stops shrinking
after 5 minutes), except in the stress test, where each smaller hanging case would cost another
full timeout. ``AGENT_INFER_FUZZ_EXAMPLES`` sets the examples per
test (``-m slow`` runs the long profile); ``benchmarks/fuzz_campaign.py`` runs the same cases for N
minutes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from fuzz_cases import grammar_cases, regex_cases, schema_cases, stress_cases
from fuzz_harness import GuardedWorker, assert_case
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.fuzz

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
_SUPPRESS.append(HealthCheck.function_scoped_fixture)
_ALL_TOKENIZERS = ("bytes", "smollm2", "deepseek")


def _profile(default: int, *, fixed: bool = True, shrink: bool = True) -> settings:
    """``AGENT_INFER_FUZZ_EXAMPLES`` (else ``default``) examples per test. ``fixed``: the same draws
    every run, so CI is stable and a sanitized run meets the cases a normal run passed; the long
    profile draws afresh. No deadline: the worker's per-case timeout is the time bound."""
    raw = os.environ.get("AGENT_INFER_FUZZ_EXAMPLES", "").strip()
    return settings(
        max_examples=int(raw) if raw else default,
        phases=list(Phase) if shrink else [Phase.explicit, Phase.generate],
        deadline=None,
        suppress_health_check=_SUPPRESS,
        derandomize=fixed,
        database=None,
    )


DEFAULT = _profile(800)
MASKS = _profile(120)
LONG = _profile(3_000, fixed=False)  # only under -m slow
# Stress cases that fail tend to hang or blow up: each shrink step could cost a full timeout.
STRESS = _profile(40, shrink=False)


@pytest.fixture(scope="module")
def worker() -> Iterator[GuardedWorker]:
    w = GuardedWorker(("bytes",))
    yield w
    w.close()


@pytest.fixture(scope="module")
def token_worker() -> Iterator[GuardedWorker]:
    w = GuardedWorker(("bytes", "smollm2", "deepseek"))
    yield w
    w.close()


# --- the harness itself: each failure kind is caught and named ----------------------------------


@pytest.mark.parametrize(
    ("action", "status"),
    [("abort", "crash"), ("segfault", "crash"), ("allocate", "blowup"), ("raise", "untyped"), ("ok", "ok")],
)
def test_harness_classifies_failures(worker: GuardedWorker, action: str, status: str) -> None:
    result = worker.run({"kind": "probe", "action": action})
    assert result["status"] == status, result
    if status == "crash":
        assert "worker died (signal SIG" in result["detail"]
    assert worker.run({"kind": "probe", "action": "ok"})["status"] == "ok"  # restarted


def test_harness_reports_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_INFER_FUZZ_TIMEOUT", "3")
    w = GuardedWorker(("bytes",))
    try:
        assert w.run({"kind": "probe", "action": "sleep"})["status"] == "hang"
        assert w.run({"kind": "probe", "action": "ok"})["status"] == "ok"
    finally:
        w.close()


# --- fuzzing ---------------------------------------------------------------------------------------


@DEFAULT
@given(case=regex_cases())
def test_fuzz_regex_matches_re(worker: GuardedWorker, case: dict[str, Any]) -> None:
    event(assert_case(worker, case))


@DEFAULT
@given(case=schema_cases())
def test_fuzz_schema_matches_jsonschema(worker: GuardedWorker, case: dict[str, Any]) -> None:
    event(assert_case(worker, case))


@DEFAULT
@given(case=grammar_cases())
def test_fuzz_grammar_text_mutations(worker: GuardedWorker, case: dict[str, Any]) -> None:
    event(assert_case(worker, case))


@MASKS
@given(case=regex_cases(("smollm2", "deepseek")))
def test_fuzz_regex_masks_exact_real_tokenizers(token_worker: GuardedWorker, case: dict[str, Any]) -> None:
    event(assert_case(token_worker, case))


@MASKS
@given(case=schema_cases(("smollm2", "deepseek")))
def test_fuzz_schema_masks_exact_real_tokenizers(token_worker: GuardedWorker, case: dict[str, Any]) -> None:
    event(assert_case(token_worker, case))


@MASKS
@given(case=grammar_cases(("smollm2", "deepseek")))
def test_fuzz_grammar_masks_exact_real_tokenizers(token_worker: GuardedWorker, case: dict[str, Any]) -> None:
    event(assert_case(token_worker, case))


@STRESS
@given(case=stress_cases())
def test_fuzz_stress_limits(worker: GuardedWorker, case: dict[str, Any]) -> None:
    event(assert_case(worker, case))


@pytest.mark.slow
@LONG
@given(
    case=st.one_of(
        *(cases(_ALL_TOKENIZERS) for cases in (regex_cases, schema_cases, grammar_cases, stress_cases))
    )
)
def test_fuzz_long(token_worker: GuardedWorker, case: dict[str, Any]) -> None:
    event(assert_case(token_worker, case))
