"""Process-wide utilities every grammar stage may use: the memo registry and the GC pause."""
