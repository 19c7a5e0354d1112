"""Checkpoint formats: GGUF (our reader, config from metadata, weights by name, packing for the native
kernel) and Hugging Face directories (``config.json`` + safetensors, block-FP8 weights dequantized at load)."""
