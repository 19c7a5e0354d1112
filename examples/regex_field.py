"""A regex-constrained value, alone and as a field of a schema.

``regex=`` constrains a whole answer; inside a Pydantic model ``Field(pattern=...)`` does the same
for one field. Run with ``.venv/bin/python examples/regex_field.py``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_infer import Client


class Ticket(BaseModel):
    ticket_id: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    summary: str = Field(max_length=60)


def main() -> None:
    """Generate a date and a ticket whose id follows a fixed format."""
    client = Client()
    date = client.generate(
        "When did the first moon landing happen? Answer as YYYY-MM-DD.", regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    )
    print("date:", date)
    ticket = client.generate("File a bug ticket about a login page that times out.", schema=Ticket)
    print("ticket:", repr(ticket))


if __name__ == "__main__":
    main()
