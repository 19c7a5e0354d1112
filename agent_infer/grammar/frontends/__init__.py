"""Front ends: each lowers one constraint language to the grammar IR.

Importing this package registers every front end with the IR (``register_frontend``), so that
``Grammar.from_regex``, ``from_json_schema`` and ``from_ebnf`` reach them without the IR importing
them. Each builder runs with the cyclic garbage collector paused (``gc_pause``): a build allocates
tens of thousands of objects that all stay alive until it ends.
"""

from __future__ import annotations

from agent_infer.grammar.common.gc_pause import pauses_gc
from agent_infer.grammar.frontends.ebnf.gbnf import parse_gbnf
from agent_infer.grammar.frontends.ebnf.lark_grammar import parse_lark
from agent_infer.grammar.frontends.json_schema.entry import json_schema_to_grammar
from agent_infer.grammar.frontends.regex.parser import regex_to_grammar
from agent_infer.grammar.ir import register_frontend

register_frontend("regex", pauses_gc(regex_to_grammar))
register_frontend("json_schema", pauses_gc(json_schema_to_grammar))
register_frontend("gbnf", pauses_gc(parse_gbnf))
register_frontend("lark", pauses_gc(parse_lark))
