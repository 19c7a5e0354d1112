"""Regular expressions (the JSON Schema ``pattern`` dialect and Python's ``re`` subset) to the IR."""
