"""Draft sources of speculative decoding: the model's MTP layers, prompt lookup, grammar-forced text."""
