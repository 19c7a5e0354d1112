"""Compilation: the IR and a tokenizer to a compiled grammar (native lowering, token tables, caches)."""
