"""The MTP draft vocabulary: which ids it keeps (ranking file, BPE merge order, id order), the
grammar mask read over its ids, its gathered head, and the option's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agent_infer.engine.config import EngineConfig
from agent_infer.engine.drafts.vocab import RANKING_FILE, DraftVocab, build_draft_vocab, merge_order
from agent_infer.errors import ConfigError, ModelLoadError
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.model.tokenizer import Tokenizer


def _bpe_tokenizer() -> Tokenizer:
    """A BPE tokenizer whose ids are not in merge order: 'ab' (id 3) is merged after 'bc' (id 4)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "<eos>": 5}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[("b", "c"), ("a", "b")]))
    hf.add_special_tokens(["<eos>"])
    return Tokenizer(hf, bos_token_id=None, eos_token_ids=[5])


def test_the_ranking_file_decides_and_eos_is_always_in(tmp_path: Path) -> None:
    (tmp_path / RANKING_FILE).write_text(json.dumps({"token_ids": [7, 3, 9, 1, 0], "counted": "test"}))
    vocab = build_draft_vocab(3, 20, tmp_path, None, always=[19])
    assert vocab.source == "file" and vocab.ids is not None
    assert vocab.ids.tolist() == [3, 7, 19]  # eos, then the two best ranked; sorted
    assert vocab.size == 3


def test_a_short_file_is_completed_in_merge_order(tmp_path: Path) -> None:
    (tmp_path / RANKING_FILE).write_text(json.dumps({"token_ids": [2]}))
    vocab = build_draft_vocab(4, 6, tmp_path, _bpe_tokenizer(), always=[5])
    assert vocab.ids is not None and vocab.ids.tolist() == [0, 1, 2, 5]  # 2, then a and b (bytes first)
    assert merge_order(_bpe_tokenizer(), 6) == [0, 1, 2, 4, 3]  # bytes, then 'bc' (rank 0), 'ab'


def test_without_a_file_merge_order_then_id_order(tmp_path: Path) -> None:
    vocab = build_draft_vocab(4, 6, tmp_path, _bpe_tokenizer(), always=[])
    assert vocab.source == "merges" and vocab.ids is not None and vocab.ids.tolist() == [0, 1, 2, 4]
    vocab = build_draft_vocab(3, 10, None, None, always=[9])
    assert vocab.source == "ids" and vocab.ids is not None and vocab.ids.tolist() == [0, 1, 9]


@pytest.mark.parametrize("size", [0, 6, 100])
def test_zero_or_the_whole_vocabulary_means_no_slice(size: int) -> None:
    vocab = build_draft_vocab(size, 6, None, None, always=[])
    assert vocab.ids is None and vocab.size == 6 and vocab.source == "full"
    weight = torch.randn(6, 4)
    assert vocab.head(weight) is weight and vocab.token(5) == 5


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json", "not a readable JSON file"),
        (json.dumps([1, 2]), "expected an object with a list 'token_ids'"),
        (json.dumps({"token_ids": [1, 50]}), r"token_ids\[1\] = 50 is not a token id"),
        (json.dumps({"token_ids": [1, True]}), r"token_ids\[1\] = True"),
        (json.dumps({"token_ids": [1, 2, 1]}), "lists an id more than once"),
    ],
)
def test_a_bad_ranking_file_is_a_load_error_naming_it(tmp_path: Path, content: str, match: str) -> None:
    (tmp_path / RANKING_FILE).write_text(content)
    with pytest.raises(ModelLoadError, match=match) as err:
        build_draft_vocab(4, 20, tmp_path, None, always=[])
    assert RANKING_FILE in str(err.value)


def test_the_head_is_the_gathered_rows_and_indices_map_back() -> None:
    vocab = DraftVocab(10, torch.tensor([1, 4, 8]), "file")
    weight = torch.arange(40, dtype=torch.float32).view(10, 4)
    head = vocab.head(weight)
    assert torch.equal(head, weight[[1, 4, 8]]) and head.data_ptr() != weight.data_ptr()
    assert [vocab.token(i) for i in range(3)] == [1, 4, 8]


def test_the_grammar_mask_is_read_at_the_draft_ids() -> None:
    vocab = DraftVocab(70, torch.tensor([0, 31, 32, 65, 69]), "file")
    mask = allocate_token_bitmask(1, 70)
    mask.zero_()
    for token in (31, 65, 66):  # 66 is not a draft id
        mask[0, token // 32] |= 1 << (token % 32)
    assert vocab.allowed(mask).tolist() == [False, True, False, True, False]
    mask.zero_()
    assert not bool(vocab.allowed(mask).any())  # nothing allowed in the draft vocabulary: the draft stops
    full = DraftVocab(70, None, "full")
    mask.fill_(-1)
    assert bool(full.allowed(mask).all()) and int(full.allowed(mask).numel()) == 70


@pytest.mark.parametrize("bad", [-1, True, 1.5, "16k"])
def test_a_bad_option_is_a_config_error_naming_it(bad: object) -> None:
    with pytest.raises(ConfigError, match="speculative_draft_vocab"):
        EngineConfig(speculative_draft_vocab=bad)  # type: ignore[arg-type]


def test_the_environment_sets_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig().speculative_draft_vocab_resolved == 16384
    monkeypatch.setenv("AGENT_INFER_SPECULATIVE_DRAFT_VOCAB", "4096")
    assert EngineConfig().speculative_draft_vocab_resolved == 4096
    assert EngineConfig(speculative_draft_vocab=0).speculative_draft_vocab_resolved == 0
    monkeypatch.setenv("AGENT_INFER_SPECULATIVE_DRAFT_VOCAB", "-3")
    with pytest.raises(ConfigError, match="AGENT_INFER_SPECULATIVE_DRAFT_VOCAB"):
        _ = EngineConfig().speculative_draft_vocab_resolved
    monkeypatch.setenv("AGENT_INFER_SPECULATIVE_DRAFT_VOCAB", "many")
    with pytest.raises(ConfigError, match="AGENT_INFER_SPECULATIVE_DRAFT_VOCAB"):
        _ = EngineConfig().speculative_draft_vocab_resolved
