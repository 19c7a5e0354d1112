"""Concrete JSON values: ``enum``/``const`` lowered to the listed values that satisfy every sibling
keyword, decided per value (by keyword, or by running the schema's own grammar)."""
