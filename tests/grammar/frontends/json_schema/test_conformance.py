"""Conformance ratchets: no case may get worse than its golden (see tests/support/conformance.py).

The default run covers the whole JSON-Schema-Test-Suite (draft 2020-12) and a fixed, seeded sample of
MaskBench dev; the full MaskBench split is ``-m slow``. Regenerate goldens only on purpose with
``python tests/support/conformance.py --suite jsts|maskbench --update``.
"""

from __future__ import annotations

from pathlib import Path

import conformance
import pytest
from shared_data import SHARED_DATA, require_shared_data


def _checker(suite: str) -> conformance.Checker:
    """The golden's checker when it is usable here, else the best available one."""
    name = conformance.load_golden(suite).get("checker")
    try:
        return conformance.make_checker(name)
    except Exception:
        return conformance.make_checker()


def _require(path: Path) -> None:
    require_shared_data(str(path.relative_to(SHARED_DATA)))


def test_golden_has_no_forbidden_false_positives() -> None:
    for suite in ("jsts", "maskbench"):
        cases = conformance.load_golden(suite)["cases"]
        bad = [k for k, v in cases.items() if v == "false-positive" and not conformance.fp_allowed(k)]
        assert not bad, f"{suite} golden contains false positives: {bad}"


@pytest.mark.parametrize("checker", ["native:deepseek", "native:smollm2"])
def test_json_schema_test_suite_ratchet(checker: str) -> None:
    """Both real tokenizers must reach the golden: token boundaries differ a lot between them."""
    _require(conformance.JSTS_DIR)
    golden = conformance.load_golden("jsts")
    results = conformance.run(
        conformance.jsts_cases(), conformance.make_checker(checker), conformance.jsts_remotes()
    )
    bad = conformance.regressions(results, golden["cases"])
    assert not bad, "\n".join(bad)


def test_maskbench_sample_ratchet() -> None:
    _require(conformance.MASKBENCH_DIR)
    golden = conformance.load_golden("maskbench")
    files = conformance.maskbench_sample()
    results = conformance.run(conformance.maskbench_cases(files), _checker("maskbench"))
    bad = conformance.regressions(results, golden["cases"])
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_maskbench_full_ratchet() -> None:
    _require(conformance.MASKBENCH_DIR)
    golden = conformance.load_golden("maskbench")
    results = conformance.run(
        conformance.maskbench_cases(conformance.maskbench_files()), _checker("maskbench")
    )
    bad = conformance.regressions(results, golden["cases"])
    assert not bad, "\n".join(bad)


def test_worse_is_the_documented_rank_order() -> None:
    rank = conformance.RANK
    assert rank["pass"] < rank["false-negative"] < rank["unsupported-error"] < rank["false-positive"]
    golden = {"a": "false-negative", "b": "unsupported-error"}
    results = {"a": conformance.Outcome("unsupported-error"), "b": conformance.Outcome("false-negative")}
    assert [line.split(":")[0] for line in conformance.regressions(results, golden)] == ["a"]
