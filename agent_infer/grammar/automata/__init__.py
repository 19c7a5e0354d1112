"""Code-point automata: the DFA algebra the JSON Schema front end uses for names, patterns and lengths."""
