"""Per-request matching: the matcher, the token bitmask and the kernels that apply it."""
