"""Grammar languages to the IR: llama.cpp's GBNF and Lark's EBNF."""
