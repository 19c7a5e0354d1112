"""JSON Schema (draft 2020-12, plus draft-07 spellings) to a grammar of exactly the valid JSON texts."""
