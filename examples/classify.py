"""Classification with ``choice=``: the answer is always exactly one of the labels.

Run with ``.venv/bin/python examples/classify.py``.
"""

from __future__ import annotations

from agent_infer import Client

LABELS = ["positive", "negative", "neutral"]
REVIEWS = [
    "Absolutely love it, works perfectly!",
    "Broke after two days. Waste of money.",
    "It arrived on Tuesday.",
]


def main() -> None:
    """Label a few product reviews."""
    client = Client()
    for review in REVIEWS:
        label = client.generate(
            f"Review: {review}\nIs the sentiment positive, negative or neutral?", choice=LABELS
        )
        print(f"{label:>8}  {review}")


if __name__ == "__main__":
    main()
