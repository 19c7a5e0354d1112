"""The agent-infer command line, run in-process on the real default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_infer.cli import main


def test_generate_with_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert (
        main(["generate", "Is water wet? Answer in JSON.", "--schema", str(path), "--max-tokens", "32"]) == 0
    )
    assert isinstance(json.loads(capsys.readouterr().out)["ok"], bool)


def test_generate_with_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Pick one.", "--choice", "left", "right"]) == 0
    assert capsys.readouterr().out.strip() in ("left", "right")


def test_bad_schema_is_reported_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"type": "string", "minLength": "x"}')
    assert main(["generate", "hi", "--schema", str(path)]) == 1
    assert "minLength" in capsys.readouterr().err


def test_serve_rejects_a_bad_limit_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--max-body-bytes", "0"]) == 1
    assert "max_body_bytes" in capsys.readouterr().err


def test_generate_with_drafts_and_a_bad_draft_length(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = "Repeat exactly: red green blue red green blue"
    assert main(["generate", prompt, "--max-tokens", "16", "--speculative-tokens", "4"]) == 0
    with_drafts = capsys.readouterr().out
    assert main(["generate", prompt, "--max-tokens", "16", "--speculative-tokens", "0"]) == 0
    assert capsys.readouterr().out == with_drafts  # greedy: drafts change the speed, not the text
    assert main(["generate", prompt, "--speculative-tokens", "-1"]) == 1
    assert "speculative_tokens" in capsys.readouterr().err
