"""The applicators that combine subschemas: ``allOf`` merged keyword by keyword, ``anyOf``/``oneOf``,
``not`` by De Morgan, ``if``/``then``/``else`` and the dependencies."""
