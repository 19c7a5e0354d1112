"""Structured extraction: turn free text into a validated Pydantic object with ``client.generate``.

Run with ``.venv/bin/python examples/extract.py`` (default model, CPU).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from agent_infer import Client


class Contact(BaseModel):
    name: str = Field(max_length=40)
    company: str = Field(max_length=40)
    role: Literal["engineer", "manager", "sales", "other"]
    email: str = Field(pattern=r"^[a-z.]+@[a-z]+\.com$")


TEXT = (
    "Hi, I'm Maria Lopez, engineering manager at Acme. Reach me at maria.lopez@acme.com if the order is late."
)


def main() -> None:
    """Extract a contact card from an e-mail signature."""
    client = Client()  # the default model, loaded on first use
    contact = client.generate(f"Extract the contact from this text as JSON:\n{TEXT}", schema=Contact)
    print(repr(contact))
    print("tokens:", client.usage)


if __name__ == "__main__":
    main()
