"""Write a checkpoint's draft-vocabulary ranking: its tokenizer's ids, most frequent first in some text.

    python scripts/draft_vocab.py --model checkpoints/tiny-deepseek-v3 --training-corpus
    python scripts/draft_vocab.py --model <folder> --text a.txt b.jsonl ...

The engine's MTP draft head chooses from the ``K`` best-ranked ids (``speculative_draft_vocab``;
``agent_infer/engine/drafts/vocab.py``). The ranking is written beside the checkpoint as
``draft_vocab.json``: ``{"token_ids": [...]}``, most frequent first (ids the text never uses are
left out: the engine ranks them by the tokenizer's merge order), and ``"counted"``, what was counted. ``--training-corpus`` counts the text ``scripts/train_tiny_deepseek.py`` trains the tiny
DeepSeek checkpoints on (the MaskBench dev schemas and the standard library's docstrings, at the
training seed); ``--text`` counts the given UTF-8 files. Counting is deterministic: ties are broken by
the lower id.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_infer.engine.drafts.vocab import RANKING_FILE, RANKING_KEY
from agent_infer.model.loading.hf import hf_config
from agent_infer.model.registry import architecture
from agent_infer.model.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]


def load_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer the engine loads for ``folder`` (its own, else its architecture's default)."""
    config = hf_config(folder)
    arch = architecture(config.architecture)
    fallback = (
        arch.default_tokenizer()
        if arch.default_tokenizer is not None and not (folder / "tokenizer.json").is_file()
        else None
    )
    return Tokenizer.from_hf_dir(
        folder,
        extra_eos_ids=config.eos_token_ids,
        fallback_dir=fallback,
        default_chat_template=arch.default_chat_template,
    )


def ranking(counts: Counter[int]) -> tuple[list[int], list[int]]:
    """Ids by descending count (ties: lower id first) and their counts."""
    order = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [t for t, _ in order], [c for _, c in order]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder (gets the file)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--training-corpus", action="store_true", help="the tiny DeepSeek training text")
    source.add_argument("--text", type=Path, nargs="+", help="UTF-8 text files to count")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "maskbench-dev")
    parser.add_argument("--seed", type=int, default=0, help="the training corpus's seed")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    counts: Counter[int] = Counter()
    counted = (
        "the tiny DeepSeek training corpus" if args.training_corpus else ", ".join(p.name for p in args.text)
    )
    if args.training_corpus:
        from tiny_deepseek.corpus import token_stream

        if not args.data.is_dir():
            parser.error(f"--data {args.data} is not a folder (the MaskBench dev schemas)")
        ids, _ = token_stream(args.data, tokenizer, args.seed)
        counts.update(ids)
    else:
        for path in args.text:
            counts.update(tokenizer.encode(path.read_text(encoding="utf-8")))
    ids, values = ranking(counts)
    out = args.model / RANKING_FILE
    out.write_text(json.dumps({RANKING_KEY: ids, "counted": counted}, separators=(",", ":")) + "\n")
    total = sum(values)
    for k in (2048, 4096, 8192, 16384, 32768):
        if k < len(values):
            print(f"top {k:>6}: {100 * sum(values[:k]) / total:.2f}% of {total:,} tokens")
    print(f"{out}: {len(ids):,} ids ranked")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
