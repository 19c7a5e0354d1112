"""JSON Schema (draft 2020-12, plus draft-07 spellings) to a grammar of exactly the valid JSON texts.

Other packages reach the front end through these names; the modules below are its internals.
"""

from agent_infer.grammar.frontends.json_schema.entry import check_options, json_schema_to_grammar, load_schema

__all__ = ["check_options", "json_schema_to_grammar", "load_schema"]
